"""What a budget policy decides for one layer, and what the measured policy predicts for the whole plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxapprox.pipeline.records import Candidate

#: FLOP comparisons' slack (sums of integers held as floats)
TOLERANCE = 1e-9


@dataclass
class Choice:
    """A policy's decision for one layer: the candidate (or ``None``: exact) and why."""

    candidate: Candidate | None
    reason: str
    predicted_error: float | None = None


@dataclass
class PolicySummary:
    """What a policy found besides the per-layer choices: the plan's predictions and what the note says.

    The fixed-ratio policies only read ``method``; the measured policy fills the rest.
    """

    method: str
    #: predicted squared model-gradient error (effective: noise averaged over ``noise_horizon`` steps) and its
    #: one-step version (what the guard measures)
    squared_error: float = 0.0
    step_squared_error: float = 0.0
    #: the pay-off model (:class:`fxapprox.passes.policy.payoff.GainModel`) and its predictions for the plan
    payoff: Any = None
    predicted_speedup: float | None = None
    predicted_steps: float | None = None
    #: ``budget="auto"``: max_grad_error refused layers; the walk stopped where the predicted gain peaked
    capped: bool = False
    stopped_for_gain: bool = False
    #: ``budget="auto"``: the best sampled plan when none reached ``min_gain`` (for the note)
    unpaid: str | None = None
    #: a numeric budget: it was spent past ``max_grad_error`` (the plan warns)
    over_tolerance: bool = False
    #: a numeric budget: layers sampled with a candidate measured slower than ``min_speedup`` (the budget needed
    #: their FLOPs)
    slow_layers: tuple[str, ...] = ()
    #: a numeric budget: what ``budget="auto"`` would do instead (``None`` without ``min_gain``)
    auto_advice: str | None = None
    #: the least fraction of exact training FLOPs any plan of the measured candidates reaches
    lowest_reachable: float | None = None
    #: the measured ÷ predicted error factors per family the plan is made with (a
    #: :class:`~fxapprox.passes.guard.replan.Calibration` from the plan's check on the example batch, or ``None``)
    calibration: Any = None
    #: the (benefit, cost) the walk ordered the hull steps by (``passes/policy/_allocation.py``)
    walked_by: tuple[str, str] = ("saving", "contribution")

    @property
    def predicted_gain(self) -> float | None:
        if self.predicted_speedup is None or self.predicted_steps is None:
            return None
        return self.predicted_speedup / self.predicted_steps
