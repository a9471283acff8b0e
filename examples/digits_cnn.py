"""A small CNN on scikit-learn's digits: exact vs the FLOP-ranked plan vs the measured plans, 3 seeds.

The digits (1797 8×8 images, 10 classes) ship with scikit-learn: nothing is
downloaded. Every configuration trains from the same initial weights and the
same batches for a given seed; evaluation is exact (``eval()``):

* ``exact``; ``flops 0.5`` — the FLOP-ranked plan (one common keep-ratio, the old default);
* ``measured 0.5`` / ``measured 0.7`` — the measured plan (the default policy) spending the budget; no guard;
* ``memory 0.125`` — ``memory_budget=0.125`` (saved activations at ~4 bits, widths by measured error).

It prints each plan's note, the final test loss and accuracy (mean ± std over seeds),
the loss at equal steps and at equal wall-clock, and with matplotlib writes test
loss against training wall-clock to a PNG.

Usage: python examples/digits_cnn.py [--epochs 25] [--seeds 3] [--plot docs/digits_cnn.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from _compare import compare, print_rows
from fxapprox.plotting import save_curves

CONFIGS = {"exact": {}, "flops 0.5": {"budget": 0.5, "policy": "flops"},
           "measured 0.5": {"budget": 0.5}, "measured 0.7": {"budget": 0.7},
           "memory 0.125": {"memory_budget": 0.125}}


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load() -> tuple:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return (x[train], y[train]), (x[test], y[test])


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(test loss, test accuracy), exact."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
        result = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()
    model.train()
    return result


def train(config: dict, seed: int, data: tuple, epochs: int, batch: int) -> tuple[list, object]:
    """``([(training seconds, epoch, test loss, test accuracy), ...], plan or None)``."""
    (x, y), (x_test, y_test) = data
    torch.manual_seed(seed)
    model = DigitsCNN()
    plan = None
    if config:
        model = fxapprox.approximate(model, config.get("budget", 1.0), memory_budget=config.get("memory_budget"),
                                     example_inputs=(x[:batch],),
                                     config=fxapprox.ApproxConfig(policy=config.get("policy", "measured"),
                                                                  check_every=None))
        plan = model.plan
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    curve = [(0.0, 0, *evaluate(model, x_test, y_test))]
    elapsed = 0.0
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        start = time.perf_counter()
        for b in range(len(y) // batch):   # full batches only: every step sees the planned shape
            index = order[b * batch:(b + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        elapsed += time.perf_counter() - start
        curve.append((elapsed, epoch, *evaluate(model, x_test, y_test)))
    return curve, plan


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--plot", default=None, help="write the test-accuracy curves to this PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = load()
    results = {}
    for name, config in CONFIGS.items():
        runs = [train(config, seed, data, args.epochs, args.batch) for seed in range(args.seeds)]
        curves = [curve for curve, _ in runs]
        plan = runs[0][1]
        # the seed-mean curve: mean time, loss and accuracy at each epoch
        mean_curve = [tuple(statistics.mean(point[i] for point in points) if i != 1 else points[0][1]
                            for i in range(4)) for points in zip(*curves)]
        results[name] = {"curve": [(t, e, loss) for t, e, loss, _ in mean_curve], "accuracy_curve": mean_curve,
                         "final_accuracy": [c[-1][3] for c in curves], "final_loss": [c[-1][2] for c in curves]}
        if plan is not None:
            results[name].update(achieved=plan.achieved, predicted_error=plan.predicted_error)
            memory = "" if plan.memory is None else f" | {plan.memory.note}"
            print(f"{name}: {plan.note}{memory}")
        accuracies = results[name]["final_accuracy"]
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        print(f"{name:14s} test loss {statistics.mean(results[name]['final_loss']):.4f}  accuracy "
              f"{statistics.mean(accuracies):.4f} ± {spread:.4f}   train {mean_curve[-1][0]:.1f} s/run", flush=True)
    rows = compare(results)
    print_rows(rows)
    if args.plot:
        save_curves(args.plot, {name: ([c[0] for c in r["curve"]], [c[2] for c in r["curve"]])
                                for name, r in results.items()},
                    xlabel="training wall-clock (s, mean of seeds)",
                    ylabel=f"test loss (mean of {args.seeds} seeds)", title="Small CNN on scikit-learn digits",
                    marker="o")
    return {"results": results, "comparison": rows}


if __name__ == "__main__":
    main()
