"""Does a plan pay? Predicted time to a given loss, against exact training.

A plan changes two things: each training step takes less time (measured: the exact model's whole step and
each sampled layer's time saving, ``measure_candidates``), and each step makes less progress, so more steps are
needed to reach the same loss. The second is modelled from the plan's predicted model-gradient error ``E``
(``budget_policy``): the plan needs

    steps(E) = 1 + error_cost · E²

times the steps of exact training (``ApproxConfig.error_cost``, fitted to training runs:
``benchmarks/bench_loss_per_second.py``, "calibration"). Its **gain** — how much sooner it reaches a given loss
— is ``speed-up / steps(E)``; above 1 it is ahead of exact training at equal wall-clock. The measured policy
stops sampling where more would lower the gain, and keeps the model exact when no plan's gain reaches
``ApproxConfig.min_gain``.

Example::

    >>> model = GainModel(exact_step_seconds=0.30, total_flops=1e12, error_cost=10.0)
    >>> round(model.gain(time_saved=0.10, flops_saved=5e11, squared_error=0.01), 3)   # 1.5x faster, 1.1x steps
    1.364
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GainModel"]


@dataclass(frozen=True)
class GainModel:
    """``speedup / steps`` of a plan; the speed-up from measured seconds, or from FLOPs when nothing was timed."""

    exact_step_seconds: float | None
    total_flops: float
    error_cost: float

    def speedup(self, time_saved: float | None, flops_saved: float) -> float:
        """Predicted exact / approximate step time (the FLOP ratio when the step was not timed)."""
        if self.exact_step_seconds and time_saved is not None:
            remaining = self.exact_step_seconds - time_saved
            return self.exact_step_seconds / remaining if remaining > 0 else float("inf")
        remaining = self.total_flops - flops_saved
        return self.total_flops / remaining if remaining > 0 else float("inf")

    def steps(self, squared_error: float) -> float:
        """Predicted steps to a given loss, as a multiple of exact training's."""
        return 1.0 + self.error_cost * max(squared_error, 0.0)

    def gain(self, time_saved: float | None, flops_saved: float, squared_error: float) -> float:
        return self.speedup(time_saved, flops_saved) / self.steps(squared_error)

    def describe(self, time_saved: float | None, flops_saved: float, squared_error: float) -> str:
        speedup, steps = self.speedup(time_saved, flops_saved), self.steps(squared_error)
        return (f"predicted {speedup:.2f}x faster per step, {steps:.2f}x the steps: "
                f"{speedup / steps:.2f}x {'sooner' if speedup >= steps else 'later'} to the same loss")
