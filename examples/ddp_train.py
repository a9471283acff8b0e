"""Data-parallel training with fxapprox and the sampled-gradient AllReduce hook.

Run with two processes on this machine (gloo, CPU)::

    torchrun --nproc_per_node=2 examples/ddp_train.py            # sampled AllReduce
    torchrun --nproc_per_node=2 examples/ddp_train.py --plain    # plain DDP, for comparison

Each rank trains an MLP on its own shard of scikit-learn's digits (shipped with
scikit-learn) at ``budget=0.5``; rank 0 prints the test accuracy, the median
step time and, with the hook, the gradient bytes all-reduced vs plain DDP.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fxapprox


def digits(rank: int, world: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    shard = train[rank::world]   # every rank its own data
    return (x[shard], y[shard]), (x[test], y[test])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", action="store_true", help="plain DDP all-reduce instead of the sampled one")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (x, y), (x_test, y_test) = digits(rank, world)
    torch.manual_seed(0)   # the same initial model and plan on every rank
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    # The FLOP-ranked plan with top-k: identical on every rank whatever its data, and every eligible layer is
    # forward-sampled, so the hook has slices to save. (A measured plan depends on the example batch and on
    # timings: plan it on the same batch everywhere with ApproxConfig(min_speedup=None).)
    approx = fxapprox.approximate(model, budget=args.budget, example_inputs=(x[:args.batch],), method="topk",
                                  config=fxapprox.ApproxConfig(policy="flops"))
    ddp = DistributedDataParallel(approx)
    state = None if args.plain else fxapprox.distributed.register_sampled_allreduce(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    step_times = []
    batches = len(y) // args.batch   # the same number of steps on every rank
    for epoch in range(args.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch * world + rank))
        ddp.train()
        for b in range(batches):
            index = order[b * args.batch:(b + 1) * args.batch]
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x[index]), y[index]).backward()
            optimizer.step()
            step_times.append(time.perf_counter() - start)
    ddp.eval()
    with torch.no_grad():
        accuracy = (ddp(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print(f"{'plain DDP' if args.plain else 'sampled AllReduce'}, budget {args.budget}: test accuracy "
              f"{accuracy:.3f}, median step {statistics.median(step_times) * 1e3:.2f} ms")
        if state is not None:
            print(f"gradient bytes all-reduced: {state.bytes_sent / 2**20:.1f} MiB vs {state.bytes_dense / 2**20:.1f} "
                  f"MiB with plain DDP ({state.sent_ratio:.1%})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
