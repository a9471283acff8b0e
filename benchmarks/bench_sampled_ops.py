"""Issue 3 speed benchmark: train steps of sampled Linear / Conv2d / ResNet-50 vs exact.

Each case builds the exact module and ``fxapprox.approximate(module, budget)``
on the same data, then times a full train step (forward + backward + SGD) of
each, interleaved, after warm-up, and reports the medians and their ratio.
The "overhead" column is the time the approximate step spends scoring and
selecting pairs (norms + top-k), measured by timing exactly those calls on the
inputs each approximated layer sees, as a share of the approximate step.

Usage: python benchmarks/bench_sampled_ops.py [--repetitions 7] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxapprox
from fxapprox.modules import APPROX_MODULE_TYPES
from fxapprox.ops.sampling import select_pairs

from _common import interleaved_medians, machine_line, markdown_table, print_table, write_section


def _train_step(module, optimizer, inputs, loss_fn):
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module(*inputs)).backward()
        optimizer.step()
    return step


def _selection_seconds(approx, inputs, loss_fn, repetitions=5) -> float:
    """Seconds per step spent in pair scoring + selection of every approximated layer."""
    captured = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: captured.append((mod, [a.detach() for a in args])))
             for m in approx.modules() if isinstance(m, APPROX_MODULE_TYPES) and m.approximating]
    loss_fn(approx(*inputs)).backward()
    for hook in hooks:
        hook.remove()

    def select_all():
        for module, args in captured:
            spec = module.fxapprox_spec
            select_pairs(spec.method, module.pair_scores(*args), spec.k, spec.random_share)

    return interleaved_medians({"select": select_all}, repetitions, warmup=1)["select"]


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_convolution", "aten::convolution_backward",
            "aten::_convolution", "aten::mkldnn_rnn_layer", "aten::mkldnn_rnn_layer_backward")


def gemm_share(step) -> float:
    """Share of a step's CPU time spent in GEMM/convolution kernels (torch.profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    return gemm / total if total else 0.0


def run_case(name, make_model, inputs, loss_fn, budget, method, repetitions, config=None):
    torch.manual_seed(0)
    exact = make_model()
    approx = fxapprox.approximate(exact, budget, example_inputs=inputs, method=method,
                                  config=config or fxapprox.ApproxConfig(policy="flops"))
    exact.train(), approx.train()
    steps = {
        "exact": _train_step(exact, torch.optim.SGD(exact.parameters(), lr=1e-3), inputs, loss_fn),
        "approx": _train_step(approx, torch.optim.SGD(approx.parameters(), lr=1e-3), inputs, loss_fn),
    }
    medians = interleaved_medians(steps, repetitions)
    selection = _selection_seconds(approx, inputs, loss_fn)
    share = gemm_share(steps["exact"])
    plan = approx.plan
    return {
        "case": name, "budget": budget, "method": method,
        "achieved": plan.achieved, "exact_s": medians["exact"], "approx_s": medians["approx"],
        "speedup": medians["exact"] / medians["approx"], "flop_limit": 1.0 / plan.achieved,
        "overhead": selection / medians["approx"],
        # Amdahl: only GEMM/conv time shrinks, by the planned FLOP fraction
        "gemm_share": share, "bound": 1.0 / (1.0 - share * (1.0 - plan.achieved)),
    }


def cases(quick: bool):
    linear_x = torch.randn(512, 2048, requires_grad=True)
    conv_x = torch.randn(16, 256, 28, 28, requires_grad=True)
    resnet_x = torch.randn(16, 3, 160, 160)
    labels = torch.randint(0, 1000, (16,))
    single = fxapprox.ApproxConfig(policy="flops", random_share=0.05)
    yield ("Linear(2048, 2048), batch 512", lambda: nn.Linear(2048, 2048), (linear_x,),
           lambda y: y.pow(2).mean(), single)
    yield ("Conv2d(256, 256, 3), 16x256x28x28", lambda: nn.Conv2d(256, 256, 3, padding=1), (conv_x,),
           lambda y: y.pow(2).mean(), single)
    if not quick:
        yield ("ResNet-50, batch 16, 3x160x160", lambda: torchvision.models.resnet50(), (resnet_x,),
               lambda y: F.cross_entropy(y, labels), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--methods", default="topk")
    parser.add_argument("--quick", action="store_true", help="skip ResNet-50, do not write BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for name, make_model, inputs, loss_fn, config in cases(args.quick):
        for budget in (float(b) for b in args.budgets.split(",")):
            for method in args.methods.split(","):
                start = time.perf_counter()
                result = run_case(name, make_model, inputs, loss_fn, budget, method, args.repetitions, config)
                print(f"{name} budget {budget} {method}: {result['speedup']:.2f}x "
                      f"({time.perf_counter() - start:.0f}s)", flush=True)
                rows.append([result["case"], f"{budget:g}", method, f"{result['achieved']:.3f}",
                             f"{result['exact_s'] * 1e3:.1f}", f"{result['approx_s'] * 1e3:.1f}",
                             f"**{result['speedup']:.2f}x**", f"{result['flop_limit']:.2f}x",
                             f"{result['gemm_share']:.0%}", f"{result['bound']:.2f}x",
                             f"{result['overhead']:.1%}"])
    headers = ["case", "budget", "method", "planned FLOPs", "exact ms", "approx ms", "speedup", "FLOP limit",
               "GEMM/conv share of exact step", "Amdahl bound", "norms+selection share"]
    print_table("train step (fwd + bwd + SGD), medians of interleaved repetitions", headers, rows)
    if not args.quick:
        write_section("sampled_ops", "\n\n".join([
            "## Sampled Linear / Conv2d / ResNet-50 train steps",
            f"`python benchmarks/bench_sampled_ops.py --repetitions {args.repetitions}` on {machine_line()}. "
            "Train step = forward + backward + SGD step; single layers take an input that requires grad "
            "(all three GEMMs run). Medians of interleaved repetitions after warm-up; 'FLOP limit' is "
            "1 / planned FLOP fraction; 'Amdahl bound' = 1 / (1 − s·(1 − f)) with s the GEMM/conv share of "
            "the exact step (torch.profiler self time) and f the planned FLOP fraction: the best a FLOP cut "
            "can do when everything else (BatchNorm, ReLU, loss, SGD) costs what it costs.",
            markdown_table(headers, rows)]))


if __name__ == "__main__":
    main()
