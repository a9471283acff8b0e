"""Data-parallel training with fxapprox and the sampled-gradient AllReduce hook.

Run with two processes on this machine (gloo, CPU)::

    torchrun --nproc_per_node=2 examples/ddp_train.py                       # sampled AllReduce
    torchrun --nproc_per_node=2 examples/ddp_train.py --hook sampled-bf16   # ... its slices sent in bf16
    torchrun --nproc_per_node=2 examples/ddp_train.py --hook plain          # plain DDP, for comparison
    torchrun --nproc_per_node=2 examples/ddp_train.py --hook powersgd --exact   # what else a user might pick

Each rank trains an MLP on its own shard of scikit-learn's digits (shipped with
scikit-learn) at ``budget=0.5`` (``--exact``: the model itself); rank 0 prints the test
accuracy, the median step time and, with the sampled hook, the gradient bytes all-reduced
vs plain DDP. ``--hook``: ``plain`` (DDP's all-reduce), ``sampled`` / ``sampled-bf16``
(:func:`fxapprox.distributed.register_sampled_allreduce`, full precision or bf16), ``bf16``
(DDP's ``bf16_compress_hook``) or ``powersgd`` (DDP's ``powerSGD_hook``, rank 2, its defaults but
``start_powerSGD_iter``: a tenth of the training's steps, as its documentation suggests to start with;
its default of 1000 plain all-reduce steps is longer than this whole training).
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


HOOKS = ("plain", "sampled", "sampled-bf16", "bf16", "powersgd")


def register_hook(ddp: DistributedDataParallel, hook: str, powersgd_start: int = 1_000):
    """Register the communication ``hook`` (one of :data:`HOOKS`) on ``ddp``; returns its state (or ``None``).
    ``powersgd_start``: PowerSGD's ``start_powerSGD_iter`` (plain all-reduce before it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "sampled":
        return fxapprox.distributed.register_sampled_allreduce(ddp)
    if hook == "sampled-bf16":
        return fxapprox.distributed.register_sampled_allreduce(ddp, dtype=torch.bfloat16)
    if hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                             start_powerSGD_iter=powersgd_start)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook", default="sampled", choices=HOOKS, help="how gradients are all-reduced")
    parser.add_argument("--plain", action="store_true", help="the same as --hook plain")
    parser.add_argument("--exact", action="store_true", help="train the model itself, not an approximation")
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
    # The default config: each rank measures on its own shard, and every rank trains with rank 0's plan (the ranks
    # agree on one plan, so the hook can send the same slices everywhere).
    hook = "plain" if args.plain else args.hook
    if not args.exact:
        model = fxapprox.approximate(model, budget=args.budget, example_inputs=(x[:args.batch],))
    elif hook.startswith("sampled"):
        parser.error("--hook sampled needs an approximated model (drop --exact)")
    # powerSGD_hook chains collectives in callbacks; under gloo, several buckets' chains interleave differently on
    # different ranks (a collective mismatch), so it gets all gradients in one bucket.
    ddp = DistributedDataParallel(model, bucket_cap_mb=512) if hook == "powersgd" else DistributedDataParallel(model)
    batches = len(y) // args.batch   # the same number of steps on every rank
    state = register_hook(ddp, hook, powersgd_start=max(2, args.epochs * batches // 10))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    step_times = []
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
        print(f"{hook}, {'exact model' if args.exact else f'budget {args.budget}'}: test accuracy "
              f"{accuracy:.3f}, median step {statistics.median(step_times) * 1e3:.2f} ms")
        if isinstance(state, fxapprox.distributed.SampledAllReduceState):
            print(f"gradient bytes all-reduced: {state.bytes_sent / 2**20:.1f} MiB vs {state.bytes_dense / 2**20:.1f} "
                  f"MiB with plain DDP ({state.sent_ratio:.1%})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
