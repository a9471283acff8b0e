"""Issue 6 benchmark: sampled-gradient AllReduce vs plain DDP, 2 gloo processes on 127.0.0.1.

Per model, three DDP variants in the same run, interleaved, median of
``--repetitions`` SGD steps after warm-up (rank 0's clock; every step ends in
the gradient all-reduce, so the ranks move in lock-step):

* ``plain DDP, exact model``;
* ``plain DDP, budget 0.5``: ``fxapprox.approximate(model, 0.5)`` with DDP's own all-reduce;
* ``sampled AllReduce, budget 0.5``: the same plus
  ``fxapprox.distributed.register_sampled_allreduce`` (bytes are what the hook counted).

Each process uses one thread (2 processes on this 2-core machine).

Usage: python benchmarks/bench_ddp.py [--repetitions 15]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))

WORLD = 2


def _models() -> dict:
    mlp = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    cnn = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    return {"MLP 1024→2048→2048→10, batch 64": (mlp, (64, 1024)),
            "CNN 3→64→128→256 conv, batch 16, 32²": (cnn, (16, 3, 32, 32))}


def _worker(rank: int, port: int, repetitions: int, out: str) -> None:
    import fxapprox
    from _common import interleaved_medians

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for label, (model, shape) in _models().items():
        torch.manual_seed(0)
        example = torch.randn(*shape)
        generator = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(*shape, generator=generator), torch.randint(0, 10, (shape[0],), generator=generator)
        exact = DistributedDataParallel(copy.deepcopy(model))
        # The FLOP-ranked plan: this benchmark is about the communication of every sampled layer.
        flops = fxapprox.ApproxConfig(policy="flops")
        plain = DistributedDataParallel(fxapprox.approximate(copy.deepcopy(model), 0.5, example_inputs=(example,),
                                                             method="topk", config=flops))
        hooked = DistributedDataParallel(fxapprox.approximate(copy.deepcopy(model), 0.5, example_inputs=(example,),
                                                              method="topk", config=flops))
        state = fxapprox.distributed.register_sampled_allreduce(hooked)
        steps = {}
        for name, ddp in (("plain DDP, exact model", exact), ("plain DDP, budget 0.5", plain),
                          ("sampled AllReduce, budget 0.5", hooked)):
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

            def step(ddp=ddp, optimizer=optimizer):
                optimizer.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
            steps[name] = step
        state.bytes_sent = state.bytes_dense = 0   # count the timed steps only (warm-up included below)
        times = interleaved_medians(steps, repetitions, warmup=2)
        results[label] = {"times": times, "bytes_sent": state.bytes_sent, "bytes_dense": state.bytes_dense,
                          "sampled_layers": len(state.sampled)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    from _common import machine_line, markdown_table, print_table, write_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=15)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(_worker, args=(port, args.repetitions, out), nprocs=WORLD, join=True)
        results = json.loads(Path(out).read_text())
    headers = ["model", "variant", "step ms", "vs plain DDP exact", "gradient bytes sent / dense"]
    rows = []
    for label, result in results.items():
        times = result["times"]
        base = times["plain DDP, exact model"]
        for name, seconds in times.items():
            ratio = (f"{result['bytes_sent'] / result['bytes_dense']:.1%}"
                     f" ({result['bytes_sent'] / 2**20:.1f} / {result['bytes_dense'] / 2**20:.1f} MiB)"
                     if name.startswith("sampled") else "100%")
            rows.append([label, name, f"{seconds * 1e3:.1f}", f"{base / seconds:.2f}×", ratio])
    title = "DDP, 2 gloo processes on 127.0.0.1 (1 thread each), SGD step"
    print_table(title, headers, rows)
    write_section("ddp", f"## Sampled-gradient AllReduce for DDP\n\n`python benchmarks/bench_ddp.py` — "
                         f"{machine_line()}\n\n**{title}** (median of {args.repetitions}, interleaved; bytes "
                         "counted by the hook over the timed and warm-up steps)\n\n" + markdown_table(headers, rows))


if __name__ == "__main__":
    main()
