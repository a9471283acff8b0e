"""Issue 15 benchmark: what sampled layers save, and the time compressed activations cost a transformer.

Sections (one run, written to BENCHMARKS.md):

* **saved-activation memory of sampled plans** — ResNet-18 (16×3×64×64), ResNet-50 (16×3×160×160) and the
  char transformer of ``examples/char_transformer.py`` (4 pre-LN blocks, d=256, 4 heads, SDPA, 16×128 tokens):
  bytes autograd keeps for backward in one training forward, exact vs ``approximate(model, 0.5)`` (measured
  and FLOP-ranked plans), and vs ``budget=0.5`` with ``memory_budget`` 0.25 and 0.125 (is the memory budget
  met?). Uncompressed plans are counted with saved-tensor hooks (``count_saved_bytes``, parameters left out);
  compressed ones with the compressor's own count (``saved_activation_stats``), as ``fxapprox bench`` does.
  The plan's count of forward-sampled layers keeping a gathered copy of their input (the rest keep the input
  itself, which something else saves anyway) is listed too.
* **transformer step time with compressed activations** — the same transformer (and a smaller one, d=192,
  T=64), forward + backward + SGD, exact vs ``memory_budget=0.125`` (default: the feed-forward's first Linear
  rebuilt so every stored value keeps 8 bits), vs ``memory_budget=0.125`` with
  ``activation_recompute=True`` (cheap rebuilds only: 4-bit copies) and vs ``activation_bits=4``; paired
  ratios (median over rounds of the variant's time / exact's time in the same round).

Usage: python benchmarks/bench_memory_plans.py [--repetitions 9] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fxapprox  # noqa: E402
from fxapprox.runtime.saved_activations import count_saved_bytes  # noqa: E402

from _common import interleaved_samples, report_tables  # noqa: E402


def _models(quick: bool):
    from char_transformer import CharTransformer

    scale = 4 if quick else 1
    yield ("ResNet-18", lambda: torchvision.models.resnet18(), torch.randn(16 // scale, 3, 64, 64))
    if not quick:
        yield ("ResNet-50", lambda: torchvision.models.resnet50(), torch.randn(16, 3, 160, 160))
    yield ("char transformer", lambda: CharTransformer(100), torch.randint(0, 100, (16 // scale, 128)))


def _saved_mib(model, x) -> float:
    """Saved-activation MiB of one training forward + backward of ``model`` on ``x``."""
    model.train()
    if getattr(model, "plan", None) is not None and model.plan.memory is not None:
        _loss(model, x).backward()
        return model.saved_activation_stats.stored_bytes / 2**20
    with count_saved_bytes(model) as counter:
        loss = _loss(model, x)
    loss.backward()
    return counter.bytes / 2**20


def _loss(model, x):
    out = model(x)
    return out.float().square().mean()


def memory_rows(quick: bool) -> list[list[str]]:
    rows = []
    for name, make, x in _models(quick):
        torch.manual_seed(0)
        model = make()
        exact = _saved_mib(model, x)
        model.zero_grad(set_to_none=True)
        rows.append([name, "exact", "-", f"{exact:.1f}", "1.00", "-", "-"])
        spent = fxapprox.ApproxConfig()   # the default measured plan, which spends the budget
        variants = [("measured, budget 0.5", dict(budget=0.5, config=spent), None),
                    ("flops, budget 0.5", dict(budget=0.5, config=fxapprox.ApproxConfig(policy="flops")), None),
                    ("measured, budget 0.5 + memory 0.25", dict(budget=0.5, memory_budget=0.25, config=spent), 0.25),
                    ("measured, budget 0.5 + memory 0.125", dict(budget=0.5, memory_budget=0.125, config=spent),
                     0.125)]
        for label, kwargs, memory_budget in variants:
            approx = fxapprox.approximate(copy.deepcopy(model), example_inputs=(x,), **kwargs)
            saved = _saved_mib(approx, x)
            ratio = saved / exact
            sampled = [d for d in approx.plan.approximated if d.mode == "forward" and d.save_input]
            gathered = sum(d.save_input == "gathered" for d in sampled)
            met = "-" if memory_budget is None else ("met" if ratio <= memory_budget else "NOT met")
            if memory_budget is None:
                met = "never more: " + ("yes" if saved <= exact * (1 + 1e-3) else "NO")
            rows.append([name, label, f"{len(approx.plan.approximated)} ({gathered} gathered of "
                                      f"{len(sampled)} forward-sampled)", f"{saved:.1f}", f"{ratio:.3f}", met,
                         f"{approx.plan.achieved:.3f}"])
            print(rows[-1], flush=True)
    return rows


def _transformer_step(model, tokens, targets):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    return step


def time_rows(repetitions: int, quick: bool) -> list[list[str]]:
    from char_transformer import CharTransformer

    rows = []
    sizes = [(192, 64)] if quick else [(256, 128), (192, 64)]
    for width, context in sizes:
        torch.manual_seed(0)
        model = CharTransformer(100, width=width, context=context)
        tokens = torch.randint(0, 100, (16, context))
        targets = torch.randint(0, 100, (16, context))
        variants = {
            "memory_budget=0.125": dict(memory_budget=0.125),
            "memory_budget=0.125, activation_recompute=True":
                dict(memory_budget=0.125, config=fxapprox.ApproxConfig(activation_recompute=True)),
            "activation_bits=4": dict(config=fxapprox.ApproxConfig(activation_bits=4)),
        }
        steps = {"exact": _transformer_step(model, tokens, targets)}
        plans = {}
        for label, kwargs in variants.items():
            approx = fxapprox.approximate(copy.deepcopy(model), 1.0, example_inputs=(tokens,), **kwargs)
            steps[label] = _transformer_step(approx, tokens, targets)
            steps[label]()   # compiles the packer
            plans[label] = approx.plan.memory
        samples = interleaved_samples(steps, repetitions, warmup=2)
        exact = statistics.median(samples["exact"])
        title = f"d={width}, T={context}"
        rows.append([title, "exact", "1.000", f"{exact * 1e3:.1f}", "1.00×", "-"])
        for label in variants:
            paired = statistics.median(v / e for v, e in zip(samples[label], samples["exact"]))
            plan = plans[label]
            rebuilt = sum(v.recomputed_from is not None for v in plan.values)
            rows.append([title, label, f"{plan.achieved:.3f}", f"{statistics.median(samples[label]) * 1e3:.1f}",
                         f"{paired:.2f}×", f"{rebuilt} rebuilt; predicted error {plan.predicted_error or 0:.3f}"])
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="small sizes, not written to BENCHMARKS.md")
    args = parser.parse_args()
    memory = memory_rows(args.quick)
    times = time_rows(2 if args.quick else args.repetitions, args.quick)
    tables = [
        ("Saved-activation memory, one training step (MiB)",
         ["model", "plan", "layers approximated", "saved MiB", "vs exact", "memory budget", "planned FLOPs"],
         memory),
        (f"Transformer train step with compressed activations (16 sequences; median of {args.repetitions}, "
         "paired ratio vs exact)",
         ["transformer", "variant", "planned bytes", "step ms", "time vs exact", "plan"], times),
    ]
    report_tables(tables, None if args.quick else "memory_plans",
                  "## Sampled layers' memory and compression time\n\n"
                  "`python benchmarks/bench_memory_plans.py`")


if __name__ == "__main__":
    main()
