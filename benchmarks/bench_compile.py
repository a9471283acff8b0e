"""Compiled exact vs compiled approximated train steps (``torch.compile``, inductor), on the default plan.

Each case builds the exact model and ``fxapprox.approximate(model, budget)`` on the same batch, compiles
both with ``torch.compile`` (default inductor backend), and times a full train step (forward + backward +
SGD) of each: interleaved rounds after warm-up (the first calls compile), the speed-up is the median of the
per-round ratios. The eager approximated step is timed alongside, and the compiled step's graph breaks are
counted with ``torch._dynamo.explain`` on the forward. The plans are the default measured policy's spending the
budget (``ApproxConfig(check_every=None)``, so that every timed step is a plain training step): what the sampled
ops gain under the compiler.

Usage: python benchmarks/bench_compile.py [--repetitions 9] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
import torchvision
from torch import nn

import fxapprox

from _common import interleaved_samples, machine_line, markdown_table, medians, paired_ratio, print_table, \
    write_section


def _step(module, inputs, loss_fn):
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module(*inputs)).backward()
        optimizer.step()
    return step


def _graph_breaks(module, inputs) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(module)(*inputs).graph_break_count


def run_case(name, make_model, inputs, loss_fn, budget, config, repetitions):
    torch.manual_seed(0)
    exact = make_model()
    approx = fxapprox.approximate(exact, budget, example_inputs=inputs, config=config)
    exact.train(), approx.train()
    breaks = _graph_breaks(approx, inputs)
    torch._dynamo.reset()
    compiled_exact, compiled_approx = torch.compile(exact), torch.compile(approx)
    steps = {"compiled exact": _step(compiled_exact, inputs, loss_fn),
             "compiled approx": _step(compiled_approx, inputs, loss_fn),
             "eager approx": _step(approx, inputs, loss_fn)}
    start = time.perf_counter()
    samples = interleaved_samples(steps, repetitions, warmup=3)
    middle = medians(samples)
    return {"case": name, "budget": budget, "achieved": approx.plan.achieved,
            "sampled": f"{len(approx.plan.approximated)}/{len(approx.plan.layers)}", "breaks": breaks,
            "exact_ms": middle["compiled exact"] * 1e3, "approx_ms": middle["compiled approx"] * 1e3,
            "eager_ms": middle["eager approx"] * 1e3,
            "speedup": paired_ratio(samples, "compiled exact", "compiled approx"),
            "seconds": time.perf_counter() - start}


CONFIGS = {"default (the budget spent)": fxapprox.ApproxConfig(check_every=None)}


def cases(quick: bool):
    x = torch.randn(512, 2048)
    yield ("3 × Linear(2048, 2048) + ReLU, batch 512",
           lambda: nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                 nn.Linear(2048, 2048)),
           (x,), lambda y: y.pow(2).mean())
    if not quick:
        images, labels = torch.randn(16, 3, 160, 160), torch.randint(0, 1000, (16,))
        yield ("ResNet-50, batch 16, 3×160×160", torchvision.models.resnet50, (images,),
               lambda y: F.cross_entropy(y, labels))
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from char_transformer import CharTransformer

        tokens, targets = torch.randint(0, 100, (16, 128)), torch.randint(0, 100, (16, 128))
        yield ("char transformer (4 blocks, width 256), batch 16×128", lambda: CharTransformer(100, 256, 4, 4, 128),
               (tokens,), lambda y: F.cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true", help="the Linear case only")
    parser.add_argument("--no-write", action="store_true", help="do not write BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for name, make_model, inputs, loss_fn in cases(args.quick):
        for policy, config in CONFIGS.items():
            result = run_case(name, make_model, inputs, loss_fn, args.budget, config, args.repetitions)
            print(f"{name}, {policy}: compiled speed-up {result['speedup']:.2f}x, {result['breaks']} graph breaks "
                  f"({result['seconds']:.0f} s)", flush=True)
            rows.append([name, policy, f"{args.budget:g}", f"{result['achieved']:.3f}", result["sampled"],
                         str(result["breaks"]), f"{result['exact_ms']:.1f}", f"{result['approx_ms']:.1f}",
                         f"**{result['speedup']:.2f}×**", f"{result['eager_ms']:.1f}"])
    headers = ["case", "config", "budget", "planned FLOPs", "sampled / layers", "graph breaks (approx)",
               "compiled exact ms", "compiled approx ms", "speed-up (paired median)", "eager approx ms"]
    print_table("compiled train step (fwd + bwd + SGD), medians of interleaved rounds", headers, rows)
    if not args.no_write:
        write_section("compile", "\n\n".join([
            "## torch.compile: compiled exact vs compiled approximated train steps (`benchmarks/bench_compile.py`)",
            f"`python benchmarks/bench_compile.py --repetitions {args.repetitions}"
            f"{' --quick' if args.quick else ''}` on {machine_line()}. Both models compiled with "
            "`torch.compile` (inductor); train step = forward + backward + SGD; interleaved rounds after "
            "three warm-up steps (which compile); speed-up = median over rounds of exact / approx in the same "
            "round. Graph breaks from `torch._dynamo.explain` on the approximated model's forward. Config: "
            "`ApproxConfig(check_every=None)` (the default measured plan spending the budget, no guard steps "
            "among the timed ones).",
            markdown_table(headers, rows)]))


if __name__ == "__main__":
    main()
