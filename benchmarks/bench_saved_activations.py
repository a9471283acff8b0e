"""Issue 4 benchmark: compressed activation saving on torchvision ResNet-50 (3×160×160) vs exact.

Sections (all in one run, written to BENCHMARKS.md):

* **saved bytes** — distinct bytes autograd keeps for backward in one training
  step, counted by saved-tensor hooks: the exact model (``count_saved_bytes``)
  vs ``saved_activation_stats`` of the approximated one (compressed copies plus
  what stays as is), batch 16.
* **step time** — forward + backward + SGD, batch 16, median of interleaved
  repetitions after warm-up (the packer is compiled during warm-up).
* **peak memory growth** — in a fresh subprocess per variant, glibc's
  ``mmap_threshold`` set low so freed tensors leave RSS; the kernel's RSS high
  water mark is reset (``/proc/self/clear_refs``) before a step and read after
  it; growth = peak − RSS before the step. Batch 32.
* **largest batch under a memory cap** — in a fresh subprocess per variant,
  the address space is capped at (current size + ``--cap-gib``) after warm-up,
  then the batch is grown until a step fails to allocate, and bisected.
* **gradient fidelity** — per-parameter cosine similarity of the gradients vs
  exact on one fixed random batch, for a small CNN on digits-sized inputs
  (64×1×8×8) and for ResNet-50.

Usage: python benchmarks/bench_saved_activations.py [--repetitions 7] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxapprox
from fxapprox import ApproxConfig
from fxapprox.runtime.saved_activations import count_saved_bytes

from _common import interleaved_medians, proc_status, report_tables, step_peak_growth

RESOLUTION = 160
VARIANTS = {  # name -> approximate() keyword arguments (budget=1: only activations change)
    "8-bit": {"config": ApproxConfig(activation_bits=8)},
    "4-bit": {"config": ApproxConfig(activation_bits=4)},
    "2-bit": {"config": ApproxConfig(activation_bits=2)},
    # widest-first widths, as when these figures were taken (the measured widths are compared in
    # examples/char_transformer.py)
    "memory_budget=0.125": {"memory_budget": 0.125, "config": ApproxConfig(activation_policy="width")},
    "memory_budget=0.0625": {"memory_budget": 0.0625, "config": ApproxConfig(activation_policy="width")},
}


def _resnet50():
    torch.manual_seed(0)
    return torchvision.models.resnet50()


def _batch(size: int):
    generator = torch.Generator().manual_seed(size)
    return (torch.randn(size, 3, RESOLUTION, RESOLUTION, generator=generator),
            torch.randint(0, 1000, (size,), generator=generator))


def _approximate(model, name: str, x):
    return fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x[:2],), **VARIANTS[name])


def _step(module, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
    return step


# -- subprocess measurements ---------------------------------------------------------------------
def _child_model(variant: str, x):
    model = _resnet50()
    return model if variant == "exact" else _approximate(model, variant, x)


def child_rss(variant: str, batch: int, steps: int) -> dict:
    x, y = _batch(batch)
    module = _child_model(variant, x)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    step = _step(module, optimizer, x, y)
    step()  # warm-up: compiles the packer, allocates gradients and optimizer state
    # gradients stay allocated: the growth is activations + temporaries
    return {"growth": step_peak_growth(step, steps, prepare=lambda: optimizer.zero_grad(set_to_none=False))}


def child_cap(variant: str, cap: int, start: int) -> dict:
    x, y = _batch(4)
    module = _child_model(variant, x)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    _step(module, optimizer, x, y)()
    gc.collect()
    limit = proc_status("VmSize") + cap
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    failures = []

    def fits(size: int) -> bool:
        xb, yb = _batch(size)
        try:
            _step(module, optimizer, xb, yb)()
            return True
        except (RuntimeError, MemoryError) as error:
            failures.append(f"{size}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            del xb, yb
            gc.collect()

    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return {"max_batch": low, "failures": failures}


def _in_subprocess(*args: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    result = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- fidelity ------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
            nn.ReLU(inplace=True))
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def _cosines(model, x, y, config) -> list[float]:
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,), config=config)
    grads = []
    for module in (approx, model):
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        grads.append([p.grad.flatten() for p in module.parameters()])
    return [F.cosine_similarity(a, b, dim=0).item() for a, b in zip(*grads)]


def fidelity_rows(quick: bool) -> list[list[str]]:
    torch.manual_seed(0)
    cases = [("small CNN, 64×1×8×8", SmallCNN(), torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))]
    if not quick:
        x, y = _batch(8)
        cases.append(("ResNet-50, 8×3×160²", _resnet50(), x, y))
    rows = []
    for label, model, x, y in cases:
        for bits in (8, 4, 2):
            cells = [label, str(bits)]
            for rounding in ("stochastic", "nearest"):
                config = ApproxConfig(activation_bits=bits, activation_rounding=rounding, activation_min_bytes=0)
                cos = sorted(_cosines(model, x, y, config))
                cells += [f"{cos[0]:.4f}", f"{cos[len(cos) // 2]:.4f}"]
            rows.append(cells)
    return rows


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="smaller, for a smoke run (not written)")
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--only-cap", action="store_true", help="only the memory-cap search (printed, not written)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, variant, *rest = args.child
        result = child_rss(variant, int(rest[0]), int(rest[1])) if kind == "rss" else \
            child_cap(variant, int(float(rest[0]) * 2**30), int(rest[1]))
        print(json.dumps(result))
        return

    if args.only_cap:
        caps = {name: _in_subprocess("cap", name, str(args.cap_gib), "16")["max_batch"] for name in ("exact", "4-bit")}
        print(caps, caps["4-bit"] / caps["exact"])
        return
    batch = 4 if args.quick else 16
    x, y = _batch(batch)
    exact = _resnet50()
    with count_saved_bytes(exact) as counter:
        F.cross_entropy(exact(x), y).backward()
    exact_bytes = counter.bytes
    exact.zero_grad(set_to_none=True)
    steps = {"exact": _step(exact, torch.optim.SGD(exact.parameters(), lr=0.01), x, y)}
    saved_rows = [["exact", f"{exact_bytes / 2**20:.1f}", "1.00×", "-"]]
    for name in VARIANTS:
        approx = _approximate(exact, name, x)
        step = _step(approx, torch.optim.SGD(approx.parameters(), lr=0.01), x, y)
        step()  # compiles the packer on first use
        stats = approx.saved_activation_stats
        saved_rows.append([name, f"{stats.stored_bytes / 2**20:.1f}", f"{exact_bytes / stats.stored_bytes:.2f}×",
                           f"{approx.plan.memory.achieved:.3f}"])
        if name in ("4-bit", "2-bit"):
            steps[name] = step
    times = interleaved_medians(steps, 2 if args.quick else args.repetitions, warmup=1)
    time_rows = [[name, f"{seconds:.3f}", f"{seconds / times['exact']:.3f}×"] for name, seconds in times.items()]

    rss_batch, rss_steps = (8, 1) if args.quick else (32, 3)
    rss = {name: _in_subprocess("rss", name, str(rss_batch), str(rss_steps))["growth"]
           for name in ("exact", "4-bit", "2-bit")}
    rss_rows = [[name, f"{growth / 2**20:.0f}", f"{rss['exact'] / growth:.2f}×"] for name, growth in rss.items()]

    cap_rows = []
    if not args.quick:
        caps = {name: _in_subprocess("cap", name, str(args.cap_gib), "16")["max_batch"]
                for name in ("exact", "4-bit", "2-bit")}
        cap_rows = [[name, str(size), f"{size / caps['exact']:.2f}×"] for name, size in caps.items()]

    fidelity = fidelity_rows(args.quick)

    tables = [
        (f"Saved activations, ResNet-50 {batch}×3×{RESOLUTION}², one train step",
         ["variant", "saved MiB", "fewer bytes", "plan (fraction of exact)"], saved_rows),
        (f"Train step time, batch {batch} (median of {args.repetitions}, interleaved)",
         ["variant", "step s", "vs exact"], time_rows),
        (f"Peak RSS growth during one step, batch {rss_batch}", ["variant", "growth MiB", "smaller"], rss_rows),
    ]
    if cap_rows:
        tables.append((f"Largest batch whose step fits {args.cap_gib:g} GiB more address space",
                       ["variant", "max batch", "vs exact"], cap_rows))
    tables.append(("Gradient cosine vs exact per parameter (min / median)",
                   ["model", "bits", "stochastic min", "stochastic median", "nearest min", "nearest median"],
                   fidelity))
    report_tables(tables, None if args.quick else "saved_activations",
                  "## Compressed saved activations\n\n"
                  "`python benchmarks/bench_saved_activations.py`")


if __name__ == "__main__":
    main()
