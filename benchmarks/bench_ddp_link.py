"""Issue 16 benchmark: DDP gradient communication over an emulated cluster link.

Two gloo ranks run inside a private network namespace whose loopback is rate-limited with a token-bucket
filter (``tc qdisc … tbf``), at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s. Nothing leaves the namespace: the ranks
talk over its own loopback, and the namespace is deleted afterwards (also when something fails). The limit
is on the loopback's egress, which both directions of the ranks' traffic share (a full-duplex cluster link of
the same rate would carry twice as much).

**Step time** (the MLP 1024→4096→4096→10, batch 32 per rank, 1 thread per rank; SGD steps, interleaved,
median over rounds of rank 0's clock) and **bytes on the link per step** (``tc -s`` counters of the
namespace's loopback, both ranks, TCP headers included) for:

* the exact model: plain DDP, DDP's ``bf16_compress_hook``, DDP's ``powerSGD_hook`` (rank 2, its defaults but
  ``start_powerSGD_iter=2``, so that the timed steps are compressed);
  every variant with all gradients in one DDP bucket (``powerSGD_hook`` needs that under gloo: with several
  buckets its chained collectives interleave differently on the two ranks and gloo aborts);
* ``fxapprox.approximate(model, 0.5)`` (FLOP-ranked plan, top-k): plain DDP, the sampled AllReduce
  (``register_sampled_allreduce``) and the sampled AllReduce with ``dtype=torch.bfloat16``.

**Accuracy at 100 Mbit/s**: ``examples/ddp_train.py`` (digits MLP, 20 epochs, 2 ranks) under each of the six,
to the end; final test accuracy and the training's wall-clock.

Needs root, ``ip`` (iproute2) and ``tc`` with the tbf qdisc; without them it says so and exits. CI does not
run it.

Usage: sudo python benchmarks/bench_ddp_link.py [--rates 10gbit,1gbit,100mbit] [--repetitions 5] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
ONE_BUCKET_MB = 512
VARIANTS = [("exact", "plain"), ("exact", "bf16"), ("exact", "powersgd"),
            ("budget 0.5", "plain"), ("budget 0.5", "sampled"), ("budget 0.5", "sampled-bf16")]
HOOK_NAMES = {"plain": "plain DDP", "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook (rank 2)",
              "sampled": "sampled AllReduce", "sampled-bf16": "sampled AllReduce, bf16"}


# -- the namespace ------------------------------------------------------------------------------
def unavailable() -> str | None:
    """Why the link cannot be emulated here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    return None


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _rate_bytes(rate: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.lower()).groups()
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8


@contextlib.contextmanager
def rate_limited_namespace(rate: str):
    """A fresh network namespace whose loopback is up and limited to ``rate``; yields its name."""
    name = f"fxapprox-link-{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "-n", name, "link", "set", "lo", "up")
        # The bucket must hold at least one timer tick of traffic at this rate (HZ may be 100).
        burst = max(256 * 1024, int(_rate_bytes(rate) / 100))
        _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
             "burst", str(burst), "latency", "100ms")
        yield name
    finally:
        deleted = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if deleted.returncode:
            print(f"bench_ddp_link: could not delete network namespace {name}: {deleted.stderr.strip()}; "
                  f"delete it with `ip netns del {name}`", file=sys.stderr)


def link_bytes() -> int:
    """Bytes this process's network namespace's loopback qdisc has sent so far (run inside the namespace)."""
    out = _run("tc", "-s", "qdisc", "show", "dev", "lo")
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


def _free_port(namespace: str) -> int:
    code = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    return int(_run("ip", "netns", "exec", namespace, sys.executable, "-c", code).strip())


def _in_namespace(namespace: str, command: list[str], env: dict) -> list[subprocess.Popen]:
    return [subprocess.Popen(["ip", "netns", "exec", namespace, *command(rank)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(WORLD)]


def _stop(processes) -> None:
    """Kill the ranks and wait for them, so that nothing is left in the namespace when it is deleted."""
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def _wait(processes, timeout: float) -> list[str]:
    outputs = []
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(processes)
            raise RuntimeError(f"a rank ran past {timeout:.0f} s")
        if process.returncode:
            _stop(processes)
            raise RuntimeError(f"a rank failed (exit {process.returncode}):\n{err[-3000:]}")
        outputs.append(out)
    return outputs


# -- the timed steps (one process per rank, inside the namespace) -------------------------------------------
def _child(rank: int, port: int, repetitions: int, namespace: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "examples"))
    from ddp_train import register_hook

    import fxapprox

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    example = torch.randn(32, 1024)
    generator = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(32, 1024, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    steps = {}
    only = os.environ.get("FXAPPROX_LINK_ONLY")   # debugging: a comma-separated subset of the hooks
    for model_kind, hook in VARIANTS:
        if only and hook not in only.split(","):
            continue
        module = copy.deepcopy(model)
        if model_kind != "exact":
            module = fxapprox.approximate(module, 0.5, example_inputs=(example,), method="topk",
                                          config=fxapprox.ApproxConfig(policy="flops"))
        # One bucket for every variant: powerSGD_hook chains collectives in callbacks, which with several buckets
        # interleave differently on the two gloo ranks (a collective mismatch), and all variants alike.
        ddp = DistributedDataParallel(module, bucket_cap_mb=ONE_BUCKET_MB)
        register_hook(ddp, hook, powersgd_start=2)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(ddp=ddp, optimizer=optimizer):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        steps[(model_kind, hook)] = step
    for _ in range(3):   # warm-up: PowerSGD compresses from its step 2 on
        for step in steps.values():
            step()
    times = {key: [] for key in steps}
    sent = {key: 0 for key in steps}
    for _ in range(repetitions):
        for key, step in steps.items():
            dist.barrier()
            before = link_bytes() if rank == 0 else 0
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
            dist.barrier()
            if rank == 0:
                sent[key] += link_bytes() - before
    if rank == 0:
        Path(out).write_text(json.dumps([{"model": m, "hook": h, "times": times[(m, h)],
                                          "bytes_per_step": sent[(m, h)] / repetitions} for m, h in steps]))
    dist.destroy_process_group()


def step_rows(rate: str, repetitions: int) -> list[dict]:
    with rate_limited_namespace(rate) as namespace, tempfile.TemporaryDirectory() as tmp:
        port = _free_port(namespace)
        out = os.path.join(tmp, "steps.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "benchmarks")}
        processes = _in_namespace(namespace, lambda rank: [sys.executable, __file__, "--child", str(rank), str(port),
                                                           str(repetitions), namespace, out], env)
        _wait(processes, timeout=3600)
        return json.loads(Path(out).read_text())


def accuracy_rows(rate: str, epochs: int) -> list[dict]:
    rows = []
    for model_kind, hook in VARIANTS:
        with rate_limited_namespace(rate) as namespace:
            port = _free_port(namespace)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": str(WORLD)}

            def command(rank):
                args = [sys.executable, str(ROOT / "examples" / "ddp_train.py"), "--hook", hook, "--epochs",
                        str(epochs)]
                return ["env", f"RANK={rank}", f"LOCAL_RANK={rank}", *args] + (["--exact"] if model_kind == "exact"
                                                                              else [])
            start = time.perf_counter()
            outputs = _wait(_in_namespace(namespace, command, env), timeout=3600)
            seconds = time.perf_counter() - start
        found = re.search(r"test accuracy ([\d.]+), median step ([\d.]+) ms", outputs[0])
        rows.append({"model": model_kind, "hook": hook, "accuracy": float(found.group(1)),
                     "step_ms": float(found.group(2)), "wall_s": seconds})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10gbit,1gbit,100mbit")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20, help="digits training epochs at the accuracy rate")
    parser.add_argument("--accuracy-rate", default="100mbit")
    parser.add_argument("--quick", action="store_true", help="1gbit only, 2 rounds, 2 epochs; not written")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rank, port, repetitions, namespace, out = args.child
        _child(int(rank), int(port), int(repetitions), namespace, out)
        return
    reason = unavailable()
    if reason:
        print(f"bench_ddp_link: skipped — {reason}")
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import report_tables

    rates = ["1gbit"] if args.quick else args.rates.split(",")
    repetitions = 2 if args.quick else args.repetitions
    step_table = []
    for rate in rates:
        results = step_rows(rate, repetitions)
        base = {r["model"]: r for r in results if r["hook"] == "plain"}
        for r in results:
            seconds = statistics.median(r["times"])
            plain = base[r["model"]]
            paired = statistics.median(p / t for p, t in zip(plain["times"], r["times"]))
            exact_plain = statistics.median(p / t for p, t in zip(base["exact"]["times"], r["times"]))
            step_table.append([rate, r["model"], HOOK_NAMES[r["hook"]], f"{seconds * 1e3:.0f}",
                               f"{paired:.2f}×", f"{exact_plain:.2f}×", f"{r['bytes_per_step'] / 2**20:.1f}"])
            print(step_table[-1], flush=True)
    accuracy = accuracy_rows(args.accuracy_rate, 2 if args.quick else args.epochs)
    accuracy_table = [[r["model"], HOOK_NAMES[r["hook"]], f"{r['accuracy']:.3f}", f"{r['step_ms']:.1f}",
                       f"{r['wall_s']:.0f}"] for r in accuracy]
    tables = [
        (f"MLP 1024→4096→4096→10, batch 32 per rank, 2 gloo ranks (1 thread each), SGD step (median of "
         f"{repetitions} interleaved rounds)",
         ["link", "model", "communication", "step ms", "vs plain DDP, same model", "vs plain DDP, exact model",
          "MiB on the link per step"], step_table),
        (f"digits MLP (examples/ddp_train.py), {args.epochs} epochs, 2 ranks, at {args.accuracy_rate}",
         ["model", "communication", "test accuracy", "median step ms", "run s (incl. start-up)"], accuracy_table),
    ]
    report_tables(tables, None if args.quick else "ddp_link",
                  "## DDP over an emulated cluster link\n\n"
                  "Two gloo ranks in a private network namespace whose loopback is limited by `tc … tbf` (both "
                  "directions share the limit). Bytes: the loopback qdisc's counter, both ranks, headers "
                  "included.\n\n`python benchmarks/bench_ddp_link.py` (as root)")


if __name__ == "__main__":
    main()
