"""Train a workload (``benchmarks/workloads.py``) under one configuration and read its learning curve.

A configuration is a label:

* ``exact`` — the plain model;
* ``B`` (a number) — ``fxapprox.approximate(model, B)``: the budget spent, the default guard (which re-plans a
  numeric budget only past ``divergence_error``);
* ``B-guard`` or ``B spent`` — the same with the guard off (``check_every=None``): what sampling does alone;
* ``B spent+guard`` — the same as ``B``;
* ``auto`` — ``fxapprox.approximate(model, "auto")`` (the default: the pay-off model chooses, the guard holds it
  to ``max_grad_error`` and ``min_gain``);
* ``memory M`` — ``fxapprox.approximate(model, 1.0, memory_budget=M)``: the compute exact, only what is saved for
  backward changes (the memory plan);
* ``fixed MODE METHOD RATIO`` — every eligible layer pinned to one mode, method and keep-ratio (no timing, no
  tolerance), the guard measuring only (``check_replan=False``, every 10 steps): calibration points.

The training clock starts before ``approximate`` (planning counts) and stops at evaluations (exact, not
counted). The curve is ``[(seconds, step, validation loss), ...]``.
"""

from __future__ import annotations

import math
import time

from torch import nn

import fxapprox
from fxapprox import ApproxConfig, LayerOverride


def approximate(model: nn.Module, label: str, example: tuple) -> nn.Module:
    if label == "exact":
        return model
    if label.startswith("fixed"):
        _, mode, method, ratio = label.split()
        config = ApproxConfig(min_speedup=None, max_grad_error=None, check_every=10, check_replan=False,
                              check_verbose=False,
                              overrides=(LayerOverride(r".*", mode=mode, method=method, keep_ratio=float(ratio)),))
        return fxapprox.approximate(model, 0.99, example_inputs=example, config=config)
    if label.startswith("memory "):
        return fxapprox.approximate(model, 1.0, memory_budget=float(label.split()[1]), example_inputs=example,
                                    config=ApproxConfig(check_verbose=False, check_every=None))
    if label == "auto":
        return fxapprox.approximate(model, "auto", example_inputs=example,
                                    config=ApproxConfig(check_verbose=False))
    budget, _, variant = label.partition(" ")
    guard = not label.endswith("-guard") and (not variant or variant.endswith("+guard"))
    config = ApproxConfig(check_verbose=False, check_every=ApproxConfig().check_every if guard else None)
    return fxapprox.approximate(model, float(budget.removesuffix("-guard")), example_inputs=example, config=config)


def train(workload, label: str, seed: int, steps: int | None = None, log=None) -> dict:
    """Train ``workload`` under ``label`` with batch order ``seed``; the curve and what the plan said."""
    steps = steps or workload.steps
    model = workload.build()
    start = time.perf_counter()
    model = approximate(model, label, workload.example)
    planning = time.perf_counter() - start
    optimizer, scheduler = workload.optimizer(model.parameters(), steps)
    batches = workload.batches(seed)
    elapsed = planning
    curve = [(elapsed, 0, workload.evaluate(model))]
    for step in range(1, steps + 1):
        x, y = next(batches)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model(x), y).backward()
        if workload.clip:
            nn.utils.clip_grad_norm_(model.parameters(), workload.clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        elapsed += time.perf_counter() - start
        if step % workload.eval_every == 0 or step == steps:
            curve.append((elapsed, step, workload.evaluate(model)))
            if log:
                log(f"  {workload.name} {label} #{seed} step {step} {elapsed:.1f} s val {curve[-1][2]:.4f}")
    result = {"workload": workload.name, "config": label, "seed": seed, "curve": curve, "planning_s": planning}
    if hasattr(model, "plan"):
        plan = model.plan
        result.update(planned_flops=plan.achieved, predicted_error=plan.predicted_error,
                      predicted_step_error=plan.predicted_step_error, note=plan.note,
                      budget=plan.budget, history=model.history.to_dict(),
                      layers=[f"{d.target}: {d.mode} {d.method} {d.keep_ratio:.2f}" for d in plan.approximated])
    return result


# -- reading curves --------------------------------------------------------------------------------------------
def loss_at(curve, seconds: float) -> float:
    """Validation loss a curve had reached at ``seconds`` (linear between evaluations; before the first
    evaluation its first loss, after the last its last)."""
    if seconds <= curve[0][0]:
        return curve[0][2]
    for (t0, _, l0), (t1, _, l1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][2]


def first_reach(curve, loss: float, index: int = 0) -> float:
    """The first time (``index=0``) or step (``index=1``) a curve reaches ``loss`` (interpolated); ``inf`` when it
    never does."""
    for a, b in zip(curve, curve[1:]):
        if b[2] <= loss:
            if a[2] <= loss:
                return a[index]
            return a[index] + (b[index] - a[index]) * (a[2] - loss) / (a[2] - b[2])
    return math.inf


def mean_curve(curves: list) -> list:
    """The seeds' mean curve: mean time and mean loss at each evaluation."""
    return [(sum(c[i][0] for c in curves) / len(curves), curves[0][i][1], sum(c[i][2] for c in curves) / len(curves))
            for i in range(min(len(c) for c in curves))]


def smoothed(curve: list) -> list:
    """The running minimum of the loss (what training has reached so far): a noisy curve's wiggles do not count
    as reaching a loss early or late."""
    best, out = math.inf, []
    for t, s, loss in curve:
        best = min(best, loss)
        out.append((t, s, best))
    return out
