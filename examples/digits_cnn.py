"""A small CNN on scikit-learn's digits: exact vs ``budget=0.5`` vs ``memory_budget=0.125`` vs both, 3 seeds.

The digits (1797 8×8 images, 10 classes) ship with scikit-learn: nothing is
downloaded. Every configuration trains from the same initial weights and the
same batches for a given seed; evaluation is exact (``eval()``). It prints the
final test accuracy (mean ± std over seeds) and wall time per configuration
and, with matplotlib installed, writes the test-accuracy curves to a PNG.

Usage: python examples/digits_cnn.py [--epochs 25] [--seeds 3] [--plot docs/digits_cnn.png]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.plotting import save_curves

CONFIGS = {"exact": {}, "budget 0.5": {"budget": 0.5}, "memory_budget 0.125": {"memory_budget": 0.125},
           "both": {"budget": 0.5, "memory_budget": 0.125}}


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


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        result = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return result


def train(config: dict, seed: int, data: tuple, epochs: int, batch: int) -> tuple[list[float], float]:
    (x, y), (x_test, y_test) = data
    torch.manual_seed(seed)
    model = DigitsCNN()
    if config:
        model = fxapprox.approximate(model, config.get("budget", 1.0), memory_budget=config.get("memory_budget"),
                                     example_inputs=(x[:batch],))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    curve = []
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for b in range(len(y) // batch):   # full batches only: every step sees the planned shape
            index = order[b * batch:(b + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        curve.append(accuracy(model, x_test, y_test))
    return curve, time.perf_counter() - start


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
        results[name] = {"curves": [curve for curve, _ in runs], "seconds": [seconds for _, seconds in runs]}
        finals = [curve[-1] for curve, _ in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"{name:22s} test accuracy {statistics.mean(finals):.4f} ± {spread:.4f}   "
              f"wall {statistics.mean(results[name]['seconds']):.1f} s/run")
    if args.plot:
        means = {name: [statistics.mean(values) for values in zip(*result["curves"])]
                 for name, result in results.items()}
        save_curves(args.plot, {name: (list(range(1, len(mean) + 1)), mean) for name, mean in means.items()},
                    xlabel="epoch", ylabel=f"test accuracy (mean of {args.seeds} seeds)",
                    title="Small CNN on scikit-learn digits", ylim=(0.8, 1.0))
    return results


if __name__ == "__main__":
    main()
