"""Fine-tuning a character LM whose blocks torch.fx cannot trace: where budget 0.5 goes, and what the LM head costs.

The model is ``tests/test_untraceable_blocks.py``'s ``CharLM`` with ``UnpackingBlock`` (attention written as
``q, k, v = (… for z in ….split(d))``, which torch.fx cannot trace), 4 blocks, d=128, a 128-character context.
It is pretrained exactly once on the CPython standard library's sources (cached under ``benchmarks/.data/``,
reloaded in seconds) and fine-tuned on another text, Python's own documentation (``pydoc_data.topics``), with
AdamW, linear warm-up and cosine decay to zero. Configurations, each over several batch orders (seeds):

* ``exact`` — the plain model;
* ``auto`` — ``fxapprox.approximate(model)``: the pay-off model decides;
* ``0.8``, ``0.5`` — ``fxapprox.approximate(model, B)``: the blocks captured region by region, their layers in the
  plan;
* ``0.5, blocks whole`` — the same with the blocks named in ``leaf_modules``: what the plan was before the blocks
  were captured (the LM head was the only layer left to sample);
* ``0.5, head forward`` — ``0.5`` with the head pinned to forward top-k at keep 0.25 (``LayerOverride``): the
  allocation that an output layer's forward error, counted like any layer's, used to allow.

Reported: final validation loss (exact, on held-out documentation text) at equal steps, against exact; at equal
wall-clock, against exact trained on its own warm-up + cosine schedule of as many steps as the configuration's run
took time (its steps ÷ the paired step-time ratio of its first plan, plus planning in exact steps: a run the guard
made exact partway is counted at its first plan's ratio throughout, which gives exact more steps where that plan
was slower than exact); the FLOP fraction planned at
the start (and at the end, where the guard re-planned); the head's plan at the start; the train step's speed-up
over exact, measured paired (steps of every configuration interleaved in one process, median of per-round
ratios). ``--write`` puts the table in BENCHMARKS.md (section ``output_layer``).

Usage: python benchmarks/output_layer.py [--seeds 0 1 2] [--steps 300] [--write]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fxapprox  # noqa: E402
from fxapprox import ApproxConfig, LayerOverride  # noqa: E402
from _common import interleaved_samples, paired_ratio, report_tables  # noqa: E402
from _text import load_corpus  # noqa: E402
from tests.test_untraceable_blocks import CharLM, UnpackingBlock  # noqa: E402

DATA = Path(__file__).resolve().parent / ".data"
VOCAB, D, HEADS, BLOCKS, CONTEXT, BATCH = 128, 128, 4, 4, 128, 16
PRETRAIN_STEPS = 1500
BUDGET = 0.5
CONFIGS = ["exact", "auto", "0.8", "0.5", "0.5, blocks whole", "0.5, head forward"]


def ascii_ids(text: str) -> torch.Tensor:
    """Characters as ids 0–127 (anything else as 127): one vocabulary for both corpora."""
    return torch.tensor([min(ord(ch), VOCAB - 1) for ch in text], dtype=torch.long)


def documentation() -> str:
    import pydoc_data.topics as topics

    return "\n".join(topics.topics[key] for key in sorted(topics.topics))


def batches(data: torch.Tensor, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=generator)
        window = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def lm_loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = CharLM(UnpackingBlock, blocks=BLOCKS, d=D, heads=HEADS, vocab=VOCAB, context=CONTEXT)
    with torch.no_grad():
        model.position.normal_(std=0.02)
    return model


def schedule(optimizer, steps: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(model, stream, steps: int, lr: float, warmup: int, log_every: int | None = None) -> None:
    """AdamW (weight decay 0.01), linear warm-up over ``warmup`` steps and cosine decay to zero, gradients clipped
    at norm 1."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = schedule(optimizer, steps, warmup)
    for step in range(steps):
        x, y = next(stream)
        loss = lm_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if log_every and step % log_every == 0:
            print(f"  step {step}: loss {loss.item():.3f}", flush=True)


def pretrained() -> torch.nn.Module:
    """The model pretrained exactly on the standard library's sources (cached: the same weights every run)."""
    model = build()
    path = DATA / f"output_layer_pretrained_d{D}_b{BLOCKS}_{PRETRAIN_STEPS}.pt"
    if path.exists():
        model.load_state_dict(torch.load(path))
        return model
    print(f"pretraining {PRETRAIN_STEPS} steps on the standard library's sources (cached at {path}) ...", flush=True)
    data = ascii_ids(load_corpus(2_000_000))
    train(model, batches(data, 1234), PRETRAIN_STEPS, lr=2e-3, warmup=PRETRAIN_STEPS // 20, log_every=250)
    DATA.mkdir(exist_ok=True)
    torch.save(model.state_dict(), path)
    return model


def approximate(model, label: str, example: tuple):
    if label == "exact":
        return model
    config = ApproxConfig(check_verbose=False)
    if label == "auto":
        return fxapprox.approximate(model, example_inputs=example, config=config)
    if label == "0.8":
        return fxapprox.approximate(model, 0.8, example_inputs=example, config=config)
    if label == "0.5, blocks whole":
        config = ApproxConfig(check_verbose=False, leaf_modules=tuple(f"blocks.{i}" for i in range(BLOCKS)))
    elif label == "0.5, head forward":
        config = ApproxConfig(check_verbose=False, overrides=(
            LayerOverride("head", mode="forward", method="topk", keep_ratio=0.25),))
    return fxapprox.approximate(model, BUDGET, example_inputs=example, config=config)


def head_plan(approx) -> str:
    plan = getattr(approx, "plan", None)
    if plan is None:
        return "–"
    head = plan.decision("head")
    return f"{head.mode} {head.method} {head.k}/{head.n}" if head.approximate else "exact"


def fine_tune(base, label: str, seed: int, steps: int, train_data, val_x, val_y) -> dict:
    model = copy.deepcopy(base)
    example = next(batches(train_data, 10_000 + seed))
    start = time.perf_counter()
    model = approximate(model, label, (example[0],))
    planning = time.perf_counter() - start
    plan = getattr(model, "plan", None)
    planned = {"achieved": 1.0 if plan is None else plan.achieved, "head": head_plan(model),
               "sampled": 0 if plan is None else len(plan.approximated),
               "layers": 0 if plan is None else len(plan.layers)}
    model.train()
    train(model, batches(train_data, seed), steps, lr=1e-3, warmup=steps // 10)
    model.eval()
    with torch.no_grad():
        val = statistics.fmean(lm_loss(model, x, y).item() for x, y in zip(val_x, val_y))
    plan = getattr(model, "plan", None)
    return {"val": val, "planning": planning, **planned, "final_achieved": 1.0 if plan is None else plan.achieved}


def step_speedups(base, train_data, rounds: int) -> tuple[dict[str, float], float]:
    """Each configuration's train step against exact, interleaved in this process (median of per-round ratios),
    and the exact step's median seconds."""
    x, y = next(batches(train_data, 999))
    steps = {}
    for label in CONFIGS:
        model = approximate(copy.deepcopy(base), label, (x,))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step(model=model, optimizer=optimizer):
            loss = lm_loss(model, x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        steps[label] = step
    samples = interleaved_samples(steps, rounds, warmup=3)
    return ({label: paired_ratio(samples, "exact", label) for label in CONFIGS},
            statistics.median(samples["exact"]))


def equal_time_steps(steps: int, speedup: float, planning: float, exact_step: float) -> int:
    """The length of the exact schedule that takes as long as ``steps`` approximated steps plus planning: the
    paired step-time ratio converts the approximated run into exact steps (two runs' clocks drift 15–20% here)."""
    return max(1, round(steps / speedup + planning / exact_step))


def _equal_time_cell(runs: list[dict]) -> str:
    timed = [100 * (r["val"] / r["equal_time_exact"] - 1) for r in runs if "equal_time_exact" in r]
    if not timed:
        return "–"
    length = round(statistics.fmean(r["equal_time_steps"] for r in runs))
    return f"{statistics.fmean(timed):+.1f}% ({min(timed):+.1f} to {max(timed):+.1f}; exact {length} steps)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    base = pretrained()
    text = documentation()
    cut = int(len(text) * 0.9)
    train_data, val_data = ascii_ids(text[:cut]), ascii_ids(text[cut:])
    val = [next(batches(val_data, 4321 + i)) for i in range(16)]
    val_x, val_y = [v[0] for v in val], [v[1] for v in val]
    base.eval()
    with torch.no_grad():
        before = statistics.fmean(lm_loss(base, x, y).item() for x, y in zip(val_x, val_y))
    print(f"validation loss before fine-tuning: {before:.4f}", flush=True)

    speedups, exact_step = step_speedups(base, train_data, args.rounds)
    print("paired step speed-ups: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedups.items())
          + f"; exact step {exact_step * 1000:.0f} ms", flush=True)
    runs: dict[str, list[dict]] = {label: [] for label in CONFIGS}
    for seed in args.seeds:   # interleaved by seed: drift hits every configuration alike
        equal_time: dict[int, float] = {}   # exact schedule length -> its final validation loss
        for label in CONFIGS:
            run = fine_tune(base, label, seed, args.steps, train_data, val_x, val_y)
            if label != "exact":
                # exact trained on its own warm-up + cosine schedule for as long as this configuration took
                length = equal_time_steps(args.steps, speedups[label], run["planning"], exact_step)
                if length not in equal_time:
                    equal_time[length] = fine_tune(base, "exact", seed, length, train_data, val_x, val_y)["val"]
                run["equal_time_steps"], run["equal_time_exact"] = length, equal_time[length]
            runs[label].append(run)
            print(f"seed {seed} {label:20s} val {run['val']:.4f} achieved {run['achieved']:.3f} → "
                  f"{run['final_achieved']:.3f} head {run['head']} (planning {run['planning']:.1f} s)"
                  + (f"; exact in the same time ({run['equal_time_steps']} steps) {run['equal_time_exact']:.4f}"
                     if label != "exact" else ""), flush=True)

    exact = [r["val"] for r in runs["exact"]]
    rows = []
    for label in CONFIGS:
        vals = [r["val"] for r in runs[label]]
        deltas = [100 * (v / e - 1) for v, e in zip(vals, exact)]
        first = runs[label][0]
        start = statistics.fmean(r["achieved"] for r in runs[label])
        end = statistics.fmean(r["final_achieved"] for r in runs[label])
        rows.append([label, f"{first['sampled']}/{first['layers']}" if first["layers"] else "–",
                     f"{start:.3f}" + ("" if abs(end - start) < 1e-3 else f" → {end:.3f}"), first["head"],
                     f"{statistics.fmean(vals):.4f}",
                     "–" if label == "exact" else f"{statistics.fmean(deltas):+.1f}% "
                                                  f"({min(deltas):+.1f} to {max(deltas):+.1f})",
                     _equal_time_cell(runs[label]),
                     f"{speedups[label]:.2f}x", f"{statistics.fmean(r['planning'] for r in runs[label]):.1f}"])
    headers = ["configuration", "sampled / layers", "FLOPs planned (→ after the guard)", "LM head", "final val loss",
               "vs exact, equal steps (per seed)", "vs exact, equal wall-clock (per seed)", "step speed-up (paired)",
               "planning s"]
    title = (f"Fine-tuning a char LM with untraceable blocks: {args.steps} steps (warm-up + cosine), seeds "
             f"{', '.join(map(str, args.seeds))}; validation loss before fine-tuning {before:.4f}")
    report_tables([(title, headers, rows)], "output_layer" if args.write else None,
                  "## Untraceable blocks and the LM head, fine-tuning (`benchmarks/output_layer.py`)")


if __name__ == "__main__":
    main()
