"""Issue 5 benchmark: sparse-backward LSTM train step vs nn.LSTM.

Single-layer LSTM 512→512, T=50, batch 64, fp32; a train step is forward +
backward of ``(output · G).sum()`` for a fixed random ``G`` (no optimizer, as
in the issue). Variants, all in the same run, interleaved, median of
``--repetitions`` after warm-up, plus the median over rounds of nn.LSTM's time / the
variant's time in the same round (steadier when the machine's speed drifts):

* ``nn.LSTM`` itself (oneDNN kernel);
* ``fxapprox dense path``: our implementation at keep-ratio 1 (``fxapprox_always_own``);
* ``budget 2/3`` and ``budget 0.5``: ``fxapprox.approximate(model, budget)``;
  the plan's gate keep-ratio is printed (≈0.5 and ≈0.25), each at every ``--block-steps`` (time steps
  sharing one choice of kept columns; 1 chooses at every step).

Each sparse variant also gets the cosine between its gradients (input and weights, concatenated) and
the exact ones for the same output gradient: what the block length costs in fidelity.

Also reports the training forward alone (same interleaving), so the step can be
split into forward and backward, and the share of the step that the per-step
column selection, gathers and scatters take (torch.profiler self time of
``topk``, ``sort``, ``index_select`` and ``index_add_``).

Usage: python benchmarks/bench_lstm.py [--repetitions 15] [--threads N] [--block-steps 1,10,50] [--quick]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import fxapprox

from _common import (interleaved_medians, interleaved_samples, machine_line, markdown_table, medians, paired_ratio,
                     print_table, write_section)


class LSTMOnly(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(size, size)

    def forward(self, x):
        return self.lstm(x)[0]


def _step(module, x, grad):
    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        (module(x) * grad).sum().backward()
    return step


def _gradients(step, module, x) -> torch.Tensor:
    step()
    return torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in module.parameters()])


def _selection_share(step) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    picked = sum(e.self_cpu_time_total for e in prof.key_averages()
                 if e.key in ("aten::index_select", "aten::index_add_", "aten::topk", "aten::sort"))
    return picked / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before measuring; the table goes to its own section")
    parser.add_argument("--block-steps", default="1,10,64",
                        help="comma-separated lstm_block_steps values for the sparse variants")
    parser.add_argument("--quick", action="store_true", help="small sizes, not written to BENCHMARKS.md")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    size, steps, batch = (128, 10, 16) if args.quick else (512, 50, 64)
    torch.manual_seed(0)
    model = LSTMOnly(size)
    x = torch.randn(steps, batch, size, requires_grad=True)
    grad = torch.randn(steps, batch, size)

    flops = fxapprox.ApproxConfig(policy="flops")   # the sparse LSTM at the budget's ratio, whatever its speed
    dense_own = fxapprox.approximate(copy.deepcopy(model), budget=0.5, example_inputs=(x,), config=flops)
    dense_own.lstm.fxapprox_spec = type(dense_own.lstm.fxapprox_spec)("topk", size, size, mode="backward")
    dense_own.lstm.fxapprox_always_own = True
    variants = {"nn.LSTM": model, "fxapprox dense path (keep 1.0)": dense_own}
    ratios = {"nn.LSTM": 1.0, "fxapprox dense path (keep 1.0)": 1.0}
    blocks = [int(b) for b in args.block_steps.split(",")]
    for name, budget in (("budget 2/3", 2 / 3), ("budget 0.5", 0.5)):
        for block in blocks:
            config = fxapprox.ApproxConfig(policy="flops", lstm_block_steps=block)
            approx = fxapprox.approximate(copy.deepcopy(model), budget=budget, example_inputs=(x,), config=config)
            label = f"{name}, block {block}"
            variants[label] = approx
            ratios[label] = approx.plan.decision("lstm").keep_ratio
    steps_fn = {name: _step(module, x, grad) for name, module in variants.items()}
    exact = _gradients(steps_fn["nn.LSTM"], model, x)
    fidelity = {name: torch.nn.functional.cosine_similarity(_gradients(steps_fn[name], variants[name], x), exact,
                                                            dim=0).item()
                for name in variants if ratios[name] < 1}
    forward_fn = {name: (lambda module=module: module(x)) for name, module in variants.items()}
    repetitions = 2 if args.quick else args.repetitions
    samples = interleaved_samples(steps_fn, repetitions, warmup=2)
    times = medians(samples)
    forward_times = interleaved_medians(forward_fn, repetitions, warmup=1)
    base = times["nn.LSTM"]
    rows = []
    for name, seconds in times.items():
        share = _selection_share(steps_fn[name]) if ratios[name] < 1 else 0.0
        forward = forward_times[name]
        rows.append([name, f"{ratios[name]:.3f}", f"{seconds * 1e3:.1f}", f"{forward * 1e3:.1f}",
                     f"{(seconds - forward) * 1e3:.1f}", f"{base / seconds:.2f}×",
                     f"{paired_ratio(samples, 'nn.LSTM', name):.2f}×",
                     f"{share:.1%}" if ratios[name] < 1 else "-",
                     f"{fidelity[name]:.3f}" if name in fidelity else "-"])
    headers = ["variant", "gate keep-ratio", "step ms", "forward ms", "step − forward ms", "speed vs nn.LSTM",
               "paired speed vs nn.LSTM", "select+gather+scatter share",
               "gradient cosine vs exact"]
    title = f"LSTM {size}→{size}, T={steps}, batch {batch}, fp32, forward + backward"
    print_table(title, headers, rows)
    if not args.quick:
        section, heading, command = "lstm", "", "python benchmarks/bench_lstm.py"
        if args.threads is not None:
            section = f"lstm_threads{args.threads}"
            heading, command = f", {args.threads} thread(s)", f"{command} --threads {args.threads}"
        write_section(section, f"## Sparse-backward LSTM{heading}\n\n`{command}` — "
                              f"{machine_line()}\n\n**{title}** (median of {args.repetitions}, interleaved)\n\n"
                      + markdown_table(headers, rows))


if __name__ == "__main__":
    main()
