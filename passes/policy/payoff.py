"""Does a plan pay? Predicted time to a given loss, against exact training.

A plan changes two things: each training step takes less time (measured: the exact model's whole step and
each sampled layer's time saving, ``measure_candidates``), and each step makes less progress, so more steps are
needed to reach the same loss. The second is modelled per family of approximation, because the two families
cost training differently for the same gradient error (``benchmarks/bench_loss_per_second.py calibrate``):

* layers sampled in their **backward** (and compressed activations) add zero-mean noise to one step's gradient;
  with ``e_b`` the one-step model-gradient error they cause (what the guard measures as ``backward_error``),
  training needs ``1 + backward_error_cost · e_b²`` times the steps (noise added to SGD's own);
* layers sampled in their **forward** change the function trained (a biased, dropout-like perturbation); with
  ``e_f`` the model output's relative error they cause (the guard's ``output_error``), ``1 + forward_error_cost
  · e_f²``.

So ``steps = 1 + backward_error_cost · e_b² + forward_error_cost · e_f²`` (the two ``ApproxConfig`` fields,
fitted at the end of warm-up + cosine schedules, ``benchmarks/time_to_quality.py``) and the plan's **gain** — how
much sooner it reaches a given loss — is ``speed-up / steps``; above 1 it is ahead of exact training at equal
wall-clock. It orders how the measured policy spends a numeric budget and is reported beside the plan; under
``budget="auto"`` it decides: the walk stops where more sampling would lower the gain, and the model stays exact
when no plan's gain reaches ``ApproxConfig.min_gain``.

The cost depends on the phase of training a family's error falls in: under a schedule whose last steps train
exactly (``"mixed"``, ``"anneal"``) a forward-sampled model is largely recovered by the exact tail, so
``ApproxConfig.error_costs`` scales each family's cost by its tail factor (measured: about 0.15 for the forward
family, 1 for the backward one).

Example::

    >>> model = GainModel(exact_step_seconds=0.30, total_flops=1e12)
    >>> round(model.gain(time_saved=0.10, flops_saved=5e11, step_cost=0.1), 3)   # 1.5x faster, 1.1x the steps
    1.364
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx

from fxapprox.passes.measurement.error_model import one_draw_errors
from fxapprox.passes.measurement.measure_candidates import EXACT_STEP_KEY
from fxapprox.pipeline.records import Candidate

__all__ = ["GainModel", "add_times", "gain_model", "predicted_cost", "step_cost", "time_saved"]


def step_cost(candidate: Candidate, backward_error_cost: float, forward_error_cost: float) -> float:
    """A measured candidate's predicted extra steps (as a fraction of exact training's): its family's cost times
    its share of that family's squared error (``step_contribution`` for the backward family, the layer's own
    one-draw output error squared for the forward one)."""
    if candidate.mode == "forward":
        return forward_error_cost * one_draw_errors(candidate).get("output", 0.0) ** 2
    return backward_error_cost * (candidate.step_contribution or 0.0)


@dataclass(frozen=True)
class GainModel:
    """``speedup / steps`` of a plan; the speed-up from measured seconds, or from FLOPs when nothing was timed."""

    exact_step_seconds: float | None
    total_flops: float

    def speedup(self, time_saved: float | None, flops_saved: float) -> float:
        """Predicted exact / approximate step time (the FLOP ratio when the step was not timed)."""
        if self.exact_step_seconds and time_saved is not None:
            remaining = self.exact_step_seconds - time_saved
            return self.exact_step_seconds / remaining if remaining > 0 else float("inf")
        remaining = self.total_flops - flops_saved
        return self.total_flops / remaining if remaining > 0 else float("inf")

    @staticmethod
    def steps(step_cost: float) -> float:
        """Predicted steps to a given loss, as a multiple of exact training's."""
        return 1.0 + max(step_cost, 0.0)

    def gain(self, time_saved: float | None, flops_saved: float, step_cost: float) -> float:
        return self.speedup(time_saved, flops_saved) / self.steps(step_cost)

    def describe(self, time_saved: float | None, flops_saved: float, step_cost: float) -> str:
        speedup, steps = self.speedup(time_saved, flops_saved), self.steps(step_cost)
        # Said as a factor above 1 either way: "2.19x later", not "0.46x later".
        timing = (f"{speedup / steps:.2f}x sooner" if speedup >= steps
                  else "never" if math.isinf(steps) else f"{steps / speedup:.2f}x later")
        return f"predicted {speedup:.2f}x faster per step, {steps:.2f}x the steps: {timing} to the same loss"


def add_times(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def time_saved(chosen: dict) -> float | None:
    """Seconds per step the chosen candidates save, measured (``None`` when one of them was not timed)."""
    total = 0.0
    for candidate in chosen.values():
        if candidate.time_saving is None:
            return None
        total += candidate.time_saving
    return total


def predicted_cost(chosen: dict) -> float:
    """The chosen candidates' predicted extra steps (``fxapprox.passes.policy.payoff``)."""
    return sum(c.step_cost or 0.0 for c in chosen.values())


def gain_model(gm: torch.fx.GraphModule, total_flops: float) -> GainModel:
    """The plan's pay-off model: the exact step's measured seconds (``measure_candidates``; the FLOP ratio stands in
    for speed when the step was not timed) and the model's training FLOPs."""
    return GainModel(gm.meta.get(EXACT_STEP_KEY), total_flops)
