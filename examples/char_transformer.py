"""A small character-level transformer on the CPython standard library's sources: exact vs approximated plans.

Pre-LN blocks with causal ``scaled_dot_product_attention``, AdamW, constant
learning rate after a short warm-up (so the exact run's curve at any time *is*
what exact training reaches in that time). The same model, initial weights and
batches are trained under each configuration:

* ``exact`` — the plain model;
* ``flops 0.5`` — ``approximate(model, 0.5, config=ApproxConfig(policy="flops"))``:
  the FLOP-ranked plan (every layer at one common keep-ratio), the old default;
* ``measured 0.5`` / ``measured 0.7`` — ``approximate(model, budget)``: the measured
  plan (errors and speed of every candidate on the example batch) spending the budget; no guard;
* ``memory 0.125`` / ``memory-width 0.125`` (with ``--configs``) — ``memory_budget=0.125``
  with the widths chosen by measured gradient error, or widest-first (the old policy);
  "planned FLOPs" is then the planned fraction of saved-activation bytes.

It prints each plan's note, the validation loss (exact evaluation) at equal steps
and at equal wall-clock (the exact curve interpolated at the approximated run's
training time), and with matplotlib writes validation loss against wall-clock.

With ``--seeds N`` every configuration trains on N batch orders (seeds 1..N) and the curves and
losses are their means: one run's final loss moves by several percent with nothing but the order of
float sums changed (exact, 1000 steps: 1.7967 with 2 threads, 1.7067 with 1), so single runs cannot
resolve differences of a few percent.

Usage: python examples/char_transformer.py [--steps 1000] [--seeds 3] [--schedule cosine]
       [--plot docs/char_transformer.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from _compare import compare, print_rows
from _text import encode, load_corpus, windows
from fxapprox.plotting import save_curves


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        batch, steps, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, steps, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, steps, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, width: int = 256, heads: int = 4, layers: int = 4, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def evaluate(model: nn.Module, batches) -> float:
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def learning_rate_factor(step: int, args) -> float:
    """Linear warm-up, then constant (``--schedule constant``) or a cosine decay to a tenth at the last step."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if getattr(args, "schedule", "constant") == "constant":
        return 1.0
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train(model: nn.Module, args, data: torch.Tensor, val_batches, label: str,
          data_seed: int = 1) -> list[tuple[float, int, float]]:
    """``[(training seconds, step, validation loss), ...]``; evaluation time is not counted."""
    stream = windows(data, args.seq, args.batch, torch.Generator().manual_seed(data_seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(step, args))
    curve = [(0.0, 0, evaluate(model, val_batches))]
    elapsed = 0.0
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        elapsed += time.perf_counter() - start
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((elapsed, step, evaluate(model, val_batches)))
            print(f"  {label:13s} step {step:5d}  {elapsed:7.1f} s  val loss {curve[-1][2]:.4f}", flush=True)
    return curve


def _approximate(model: nn.Module, label: str, example: tuple, result: dict, announce: bool) -> nn.Module:
    kind, budget = label.split()
    start = time.perf_counter()
    if kind.startswith("memory"):   # saved activations only: "memory B" (measured widths), "memory-width B"
        policy = "width" if kind == "memory-width" else "measured"
        model = fxapprox.approximate(model, 1.0, memory_budget=float(budget), example_inputs=example,
                                     config=fxapprox.ApproxConfig(activation_policy=policy, progress=True))
    else:
        model = fxapprox.approximate(model, float(budget), example_inputs=example,
                                     config=fxapprox.ApproxConfig(policy=kind, progress=True, check_every=None))
    plan = model.plan
    note = plan.note if plan.memory is None else plan.memory.note
    result.update(achieved=plan.achieved if plan.memory is None else plan.memory.achieved,
                  predicted_error=plan.predicted_error if plan.memory is None else plan.memory.predicted_error,
                  planning_s=time.perf_counter() - start, note=note,
                  layers=[{"layer": d.target, "mode": d.mode, "method": d.method, "keep": d.keep_ratio,
                           "predicted_error": d.predicted_error, "speedup": d.measured_speedup}
                          for d in plan.approximated])
    if announce:
        print(f"{label}: planned in {result['planning_s']:.1f} s — {note}")
        for d in plan.approximated:
            speed = "" if d.measured_speedup is None else f" {d.measured_speedup:.2f}x"
            print(f"    {d.target:18s} {d.mode:11s} {d.method:8s} keep {d.keep_ratio:.2f}{speed}")
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                        help="learning rate after warm-up: constant (curves comparable at any time) or a cosine "
                             "decay to a tenth at the last step (final losses that vary far less between runs)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1,
                        help="batch orders per configuration (seeds 1..N); curves and losses are their means")
    parser.add_argument("--configs", default="exact,flops 0.5,measured 0.5,measured 0.7",
                        help="comma-separated: exact, 'flops B', 'measured B', 'memory B', 'memory-width B'")
    parser.add_argument("--plot", default=None, help="write validation loss vs wall-clock to this PNG")
    parser.add_argument("--json", default=None, help="write the curves and the comparison to this JSON file")
    args = parser.parse_args(argv)

    data, vocab = encode(load_corpus(args.corpus_bytes))
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    val_stream = windows(val_data, args.seq, 32, torch.Generator().manual_seed(2))
    val_batches = [next(val_stream) for _ in range(8)]
    print(f"corpus: {len(data):,} characters of CPython's standard library, vocabulary {len(vocab)}; "
          f"{torch.get_num_threads()} threads")

    torch.manual_seed(0)
    base = CharTransformer(len(vocab), args.width, args.heads, args.layers, args.seq)
    example = (next(windows(train_data, args.seq, args.batch, torch.Generator().manual_seed(3)))[0],)
    results = {}
    for label in [c.strip() for c in args.configs.split(",")]:
        result: dict = {}
        curves = []
        for seed in range(1, args.seeds + 1):
            model = copy.deepcopy(base)
            if label != "exact":
                model = _approximate(model, label, example, result, announce=seed == 1)
            curves.append(train(model, args, train_data, val_batches, label if args.seeds == 1 else f"{label} #{seed}",
                                data_seed=seed))
        # the seed-mean curve: mean training time and mean validation loss at each evaluation
        result["curve"] = [(sum(c[i][0] for c in curves) / len(curves), curves[0][i][1],
                            sum(c[i][2] for c in curves) / len(curves)) for i in range(len(curves[0]))]
        result["final_losses"] = [c[-1][2] for c in curves]
        results[label] = result
        if args.seeds > 1:
            finals = result["final_losses"]
            print(f"{label}: final val loss per seed {', '.join(f'{f:.4f}' for f in finals)}; mean "
                  f"{statistics.mean(finals):.4f} ± {statistics.stdev(finals):.4f}")
    rows = compare(results)
    print_rows(rows)
    if args.plot:
        save_curves(args.plot, {label: ([c[0] for c in r["curve"]], [c[2] for c in r["curve"]])
                                for label, r in results.items()},
                    xlabel="training wall-clock (s)", ylabel="validation loss (nats/char)",
                    title="char transformer on CPython stdlib", marker="o")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results, "comparison": rows}, handle, indent=1)
    return {"results": results, "comparison": rows}


if __name__ == "__main__":
    main()
