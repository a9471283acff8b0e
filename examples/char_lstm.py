"""Character-level LSTM language model on the CPython standard library's sources: dense vs sparse vs mixed.

Every machine with Python has the corpus: the ``.py`` files next to ``os.py``.
The same model (embedding → LSTM → linear decoder) is trained from the same
initial weights and batches under each configuration:

* **dense** — the plain model (``nn.LSTM``);
* **sparse** — the FLOP-ranked plan (``policy="flops"``) at ``--budget``: the LSTM's
  backward keeps the top gate-gradient columns (the decoder is kept exact so the
  comparison is about the LSTM);
* **mixed** — the same, with :class:`fxapprox.SparseThenDense`: sparse for the
  first ¾ of the steps, exact for the last ¼;
* **measured 0.5** / **measured 0.7** — ``approximate(model, budget)`` with the default
  measured policy, nothing excluded: it decides from measured errors and speed how to spend the
  budget; there is no guard.

It prints validation loss (exact evaluation) at equal steps and at equal
wall-clock and, with matplotlib installed, writes a PNG of the curves.

Usage: python examples/char_lstm.py [--steps 600] [--budget 0.667] [--plot char_lstm.png]
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from _compare import compare, print_rows
from _text import load_corpus, windows
from fxapprox.plotting import save_curves


class CharLM(nn.Module):
    def __init__(self, vocab: int, embed: int = 64, hidden: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden)
        self.decode = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.decode(self.lstm(self.embed(tokens))[0])


def evaluate(model, val_batches) -> float:
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


def warm_up(model, tokens) -> None:
    """One untimed forward + backward on a copy: one-time costs (the sparse backward's compiled kernel, ~3 s
    the first time, cached on disk after) stay out of the training wall-clock."""
    F.cross_entropy(copy.deepcopy(model)(tokens).flatten(0, 1), tokens.flatten()).backward()


def train(model, schedule, args, data, val_batches, label):
    generator = torch.Generator().manual_seed(1)
    stream = windows(data, args.seq, args.batch, generator, batch_first=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    curve = [(0.0, 0, evaluate(model, val_batches))]
    elapsed = 0.0
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        if schedule is not None:
            schedule.step()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed += time.perf_counter() - start
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((elapsed, step, evaluate(model, val_batches)))
            print(f"  {label:6s} step {step:4d}  {elapsed:6.1f} s  val loss {curve[-1][2]:.4f}", flush=True)
    return curve


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--budget", type=float, default=2 / 3)
    parser.add_argument("--sparse-fraction", type=float, default=0.75)
    parser.add_argument("--block-steps", type=int, default=fxapprox.ApproxConfig.lstm_block_steps,
                        help="time steps sharing one choice of kept gate columns (ApproxConfig.lstm_block_steps)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--configs", default="dense,sparse,mixed,measured 0.5,measured 0.7",
                        help="comma-separated: dense, sparse, mixed, 'measured B'")
    parser.add_argument("--plot", default=None, help="write the learning curves to this PNG (needs matplotlib)")
    args = parser.parse_args(argv)

    text = load_corpus(args.corpus_bytes)
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    val_stream = windows(val_data, args.seq, args.batch, torch.Generator().manual_seed(2), batch_first=False)
    val_batches = [next(val_stream) for _ in range(8)]
    print(f"corpus: {len(text):,} characters of CPython's standard library, vocabulary {len(vocab)}")

    torch.manual_seed(0)
    base = CharLM(len(vocab), hidden=args.hidden)
    config = fxapprox.ApproxConfig(policy="flops", lstm_block_steps=args.block_steps,
                                   overrides=(fxapprox.LayerOverride("decode", exclude=True),
                                              fxapprox.LayerOverride("embed", exclude=True)))
    example = (next(windows(train_data, args.seq, args.batch, torch.Generator().manual_seed(3), batch_first=False))[0],)
    results = {}
    for label in [c.strip() for c in args.configs.split(",")]:
        model = copy.deepcopy(base)
        schedule = None
        result: dict = {}
        if label != "dense":
            if label.startswith("measured"):
                measured = fxapprox.ApproxConfig(lstm_block_steps=args.block_steps, check_every=None)
                model = fxapprox.approximate(model, float(label.split()[1]), example_inputs=example, config=measured)
            else:
                model = fxapprox.approximate(model, args.budget, example_inputs=example, config=config)
            plan = model.plan
            result.update(achieved=plan.achieved, predicted_error=plan.predicted_error)
            decision = plan.decision("lstm")
            lstm = f"keep-ratio {decision.keep_ratio:.3f}" if decision.approximate else f"exact: {decision.reason}"
            print(f"{label}: {plan.note}; LSTM {lstm}")
            if label == "mixed":
                schedule = fxapprox.SparseThenDense(model, args.steps, args.sparse_fraction)
        warm_up(model, example[0])
        result["curve"] = train(model, schedule, args, train_data, val_batches, label)
        results[label] = result

    rows = compare(results, "dense")
    print_rows(rows)
    for row in rows:
        print(f"  {row['config']}: perplexity {math.exp(row['val_loss']):.2f}")
    if args.plot:
        save_curves(args.plot, {label: ([c[0] for c in r["curve"]], [c[2] for c in r["curve"]])
                                for label, r in results.items()},
                    xlabel="training wall-clock (s)", ylabel="validation loss (nats/char)",
                    title=f"char-LSTM on CPython stdlib, budget {args.budget:.2f}", marker="o")
    return {"results": results, "comparison": rows}


if __name__ == "__main__":
    main()
