"""Behaviour fingerprint for refactors: plans (JSON), reports (text) and gradients of the example models.

``--save PATH`` writes the fingerprint; ``--compare PATH`` computes it again and lists every difference (exit 1 if
any). Deterministic: timing is off (``min_speedup=None``), seeds fixed, one thread. The models: an MLP, a small
CNN, the char transformer (measured, FLOP and uniform policies, with a memory plan) and an LSTM.

Usage: python benchmarks/refactor_check.py --save before.json; (refactor); python benchmarks/refactor_check.py
--compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import fxapprox  # noqa: E402


def _models():
    from char_transformer import CharTransformer

    yield "mlp", lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(),
                                       nn.Linear(256, 10)), (torch.randn(32, 64),)
    yield "cnn", lambda: nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                       nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                       nn.Flatten(), nn.Linear(64, 10)), (torch.randn(4, 3, 16, 16),)
    yield "char transformer", lambda: CharTransformer(50, 64, 2, 2, 32), (torch.randint(0, 50, (4, 32)),)
    yield "lstm", lambda: nn.LSTM(32, 64, num_layers=2), (torch.randn(12, 4, 32),)


CONFIGS = {
    "measured": dict(budget=0.5, config=fxapprox.ApproxConfig(min_speedup=None, check_every=None, min_channels=8)),
    "flops": dict(budget=0.5, config=fxapprox.ApproxConfig(policy="flops", check_every=None, min_channels=8)),
    "uniform": dict(budget=0.5, config=fxapprox.ApproxConfig(policy="uniform", check_every=None, min_channels=8)),
    "memory": dict(budget=1.0, memory_budget=0.25,
                   config=fxapprox.ApproxConfig(min_speedup=None, check_every=None, activation_min_bytes=0)),
}


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def _strip_timings(value):
    """Plans carry measured seconds even with timing off (the whole-step timing): leave them out."""
    if isinstance(value, dict):
        return {k: _strip_timings(v) for k, v in value.items()
                if not any(word in k for word in ("seconds", "speedup", "time", "gain"))}
    if isinstance(value, list):
        return [_strip_timings(v) for v in value]
    return value


def fingerprint() -> dict:
    torch.set_num_threads(1)
    result = {}
    torch.manual_seed(0)
    models = list(_models())   # the example inputs are drawn here, seeded
    for name, make, inputs in models:
        for label, kwargs in CONFIGS.items():
            if name == "lstm" and label == "memory":
                continue
            torch.manual_seed(0)
            model = make()
            approx = fxapprox.approximate(model, example_inputs=inputs, **kwargs)
            torch.manual_seed(1)
            out = approx(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()
            result[f"{name} / {label}"] = {
                "plan": _strip_timings(approx.plan.to_dict()),
                "gradients": {n: _digest(p.grad) for n, p in approx.named_parameters() if p.grad is not None},
                "report_lines": len(str(approx.report).splitlines()),
            }
    return json.loads(json.dumps(result, default=str))


def _differences(before, after, path="") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += _differences(before.get(key), after.get(key), f"{path}/{key}")
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in _differences(b, a, f"{path}[{i}]")]
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", type=Path)
    group.add_argument("--compare", type=Path)
    args = parser.parse_args()
    current = fingerprint()
    if args.save:
        args.save.write_text(json.dumps(current, indent=1))
        print(f"saved {len(current)} fingerprints to {args.save}")
        return
    found = _differences(json.loads(args.compare.read_text()), current)
    for line in found[:50]:
        print(line)
    print(f"{len(current)} fingerprints, {len(found)} difference(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
