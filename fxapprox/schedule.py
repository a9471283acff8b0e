"""Approximation schedules: when over a training run the plan is in force, and how strongly.

A plan says how each layer samples on one step; a schedule says on which steps, at what strength. The strength
``s`` of a step scales every sampled layer's dropped share: a layer planned to keep ``k`` of ``n`` pairs keeps
``n − s·(n − k)`` (``s = 1``: the plan; ``s = 0``: exact), so a step at strength ``s`` executes
``1 − s·(1 − achieved)`` of exact training FLOPs. ``ApproxConfig(schedule=..., total_steps=N)`` chooses one:

* ``"constant"`` — the plan on every step (the default without ``total_steps``);
* ``"mixed"`` — the plan for the first ``1 − exact_fraction`` of the ``N`` steps, exact for the rest: Zhu et al.'s
  sparse-then-dense schedule, for every op kind (the default with ``total_steps``);
* ``"anneal"`` — the strength falls linearly from 1 to 0 over the first ``1 − exact_fraction`` of the steps (in
  eight stages, so a compiled step recompiles at most eight times), exact after: keep-ratios annealed toward 1;
* ``"noise"`` — measured: the guard estimates the gradient noise scale (McCandlish et al. 2018,
  ``B_noise = tr(Σ) / |G|²``) from the exact gradients of two consecutive checked steps, and lowers the strength
  (raises keep-ratios) as the noise scale grows — see :class:`NoiseScale`.

:class:`SparseThenDense` is the same mixed schedule driven by hand through ``set_approximate``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fxapprox._validate import check_fraction, check_int

__all__ = ["ANNEAL_STAGES", "NOISE_LEVELS", "SCHEDULES", "NoiseScale", "ScheduleRecord", "SparseThenDense",
           "sampled_steps", "schedule_strength", "step_fraction", "whole_run_fraction"]

#: the schedules ``ApproxConfig(schedule=...)`` accepts
SCHEDULES = ("constant", "mixed", "anneal", "noise")
#: strength levels of ``"anneal"`` (besides 0): the keep-ratios change at most this many times
ANNEAL_STAGES = 8
#: strengths ``"noise"`` chooses from, strongest first
NOISE_LEVELS = (1.0, 0.75, 0.5, 0.25, 0.0)


def sampled_steps(total_steps: int, exact_fraction: float) -> int:
    """The steps before the exact tail: the tail is ``exact_fraction`` of the steps, rounded up (a tail of 2.5
    steps is 3), so a short run with an exact share still ends exactly."""
    return total_steps - math.ceil(exact_fraction * total_steps - 1e-9)


def schedule_strength(kind: str, step: int, total_steps: int | None, exact_fraction: float) -> float:
    """The strength of training step ``step`` (1-based) under a step-driven schedule (``"noise"`` is driven by
    measurements: it returns 1 here and :class:`NoiseScale` lowers it)."""
    if kind in ("constant", "noise") or total_steps is None:
        return 1.0
    sampled = sampled_steps(total_steps, exact_fraction)
    if step > sampled:
        return 0.0
    if kind == "mixed":
        return 1.0
    # anneal: stage j of ANNEAL_STAGES runs at strength 1 − j / ANNEAL_STAGES
    stage = min(ANNEAL_STAGES - 1, (step - 1) * ANNEAL_STAGES // max(1, sampled))
    return 1.0 - stage / ANNEAL_STAGES


def step_fraction(strength: float, achieved: float) -> float:
    """Training FLOPs of a step at ``strength`` as a fraction of exact, for a plan executing ``achieved``: the
    sampled products' FLOPs are linear in their kept pairs."""
    return 1.0 - strength * (1.0 - achieved)


def whole_run_fraction(kind: str, total_steps: int | None, exact_fraction: float, achieved: float) -> float | None:
    """Predicted training FLOPs of the whole run as a fraction of exact training's; ``None`` where it is not known
    in advance (``"noise"``, or no ``total_steps``: then it is the plan's ``achieved`` for ``"constant"``)."""
    if kind == "constant":
        return achieved
    if kind == "noise" or total_steps is None:
        return None
    sampled = sampled_steps(total_steps, exact_fraction)
    if kind == "mixed":
        strength_steps = float(sampled)
    else:   # anneal: stage j covers the steps t (0-based) with t·ANNEAL_STAGES // sampled == j
        bounds = [min(sampled, -(-j * sampled // ANNEAL_STAGES)) for j in range(ANNEAL_STAGES + 1)]
        strength_steps = sum((1.0 - j / ANNEAL_STAGES) * (bounds[j + 1] - bounds[j]) for j in range(ANNEAL_STAGES))
    return 1.0 - strength_steps * (1.0 - achieved) / total_steps


@dataclass(frozen=True)
class ScheduleRecord:
    """The schedule a plan runs under (``Plan.schedule``), as the report shows it."""

    kind: str
    total_steps: int | None
    exact_fraction: float
    #: the steps the plan (or a lowered strength) is in force before the exact tail; ``None``: every step
    sampled_steps: int | None
    #: predicted whole-run training FLOPs as a fraction of exact training's (``None``: decided by measurement)
    whole_run_flops: float | None

    @classmethod
    def of(cls, kind: str, total_steps: int | None, exact_fraction: float, achieved: float) -> "ScheduleRecord":
        sampled = None if total_steps is None or kind in ("constant", "noise") else \
            sampled_steps(total_steps, exact_fraction)
        return cls(kind=kind, total_steps=total_steps, exact_fraction=exact_fraction, sampled_steps=sampled,
                   whole_run_flops=whole_run_fraction(kind, total_steps, exact_fraction, achieved))

    def describe(self) -> str:
        """One phrase: what happens when, and the whole run's FLOPs."""
        over = "" if self.total_steps is None else f" over {self.total_steps} steps"
        if self.kind == "constant":
            text = f"constant{over}: the plan on every step"
        elif self.kind == "mixed":
            text = f"mixed{over}: the plan for steps 1–{self.sampled_steps}, exact after"
        elif self.kind == "anneal":
            text = (f"anneal{over}: keep-ratios raised from the plan's toward 1 in {ANNEAL_STAGES} stages over steps "
                    f"1–{self.sampled_steps}, exact after")
        else:
            text = (f"noise{over}: keep-ratios raised as the measured gradient noise scale grows (checked every "
                    f"check_every steps)")
        if self.whole_run_flops is not None:
            text += f"; whole run {self.whole_run_flops:.3f} of exact training FLOPs"
        return text

    def to_dict(self) -> dict:
        return asdict(self)


class NoiseScale:
    """The gradient noise scale from pairs of exact gradients, and the strength it calls for.

    Two independent batches' exact gradients ``g_a, g_b`` at (nearly) the same weights give ``E⟨g_a, g_b⟩ = |G|²``
    and ``E|g|² = |G|² + tr(Σ)/B``, so ``ν = B_noise / B = (|g|² − ⟨g_a, g_b⟩) / ⟨g_a, g_b⟩``: the minibatch
    noise against the true gradient. Numerator and denominator are averaged over pairs (an exponential moving
    average, as McCandlish et al. do) before they are divided.

    A sampled step at strength ``s`` keeps ``r(s) = 1 − s·(1 − achieved)`` of the exact step's products; the
    schedule counts it as a step on an ``r(s)``-sized batch, which needs ``(1 + ν / r) / (1 + ν)`` times the steps
    (McCandlish's ``S = S_min (1 + B_noise / B)``) while running ``speed(s)`` times faster (the measured step speed-up
    interpolated linearly in step time). The strength with the most speed per step needed is kept; it never rises
    again (the noise scale grows as training goes on).
    """

    def __init__(self, decay: float = 0.5, ranks: int = 1) -> None:
        self.decay = decay
        #: data-parallel ranks: each estimate is made on one rank's batch, the step averages ``ranks`` of them
        self.ranks = ranks
        self.signal = None    # EMA of ⟨g_a, g_b⟩
        self.total = None     # EMA of (|g_a|² + |g_b|²) / 2

    def update(self, inner: float, squared_norms: float) -> None:
        if self.signal is None:
            self.signal, self.total = inner, squared_norms
        else:
            self.signal = self.decay * self.signal + (1 - self.decay) * inner
            self.total = self.decay * self.total + (1 - self.decay) * squared_norms

    @property
    def ratio(self) -> float | None:
        """``ν = B_noise / B`` (``inf`` when the gradients' common part is not positive: all noise)."""
        if self.signal is None:
            return None
        if self.signal <= 0:
            return math.inf
        return max(0.0, (self.total - self.signal) / self.signal) / self.ranks

    def strength(self, current: float, speedup: float, achieved: float) -> float:
        """The strength with the largest predicted gain (speed per step ÷ steps needed), at most ``current``."""
        ratio = self.ratio
        if ratio is None:
            return current
        best, best_gain = 0.0, 1.0
        for level in NOISE_LEVELS:
            if level > current or level == 0.0:
                continue
            gain = self.gain(level, ratio, speedup, achieved)
            if gain > best_gain:
                best, best_gain = level, gain
        return best

    @staticmethod
    def gain(strength: float, ratio: float, speedup: float, achieved: float) -> float:
        if math.isinf(ratio):
            return 0.0
        kept = step_fraction(strength, achieved)
        speed = 1.0 / (1.0 - strength * (1.0 - 1.0 / speedup))
        steps = (1.0 + ratio / kept) / (1.0 + ratio)
        return speed / steps


class SparseThenDense:
    """Approximate for the first ``sparse_fraction`` of ``total_steps``, exact afterwards.

    Call :meth:`step` once per training step, before the forward pass. ``ApproxConfig(schedule="mixed",
    total_steps=N, exact_fraction=1 - sparse_fraction)`` does the same without the call (and for every plan).

    Example::

        >>> schedule = fxapprox.SparseThenDense(approx, total_steps=1000, sparse_fraction=0.75)
        >>> for x, y in loader:
        ...     schedule.step()                  # steps 0..749 approximate, 750.. exact
        ...     loss_fn(approx(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, approx, total_steps: int, sparse_fraction: float = 0.75) -> None:
        if not hasattr(approx, "set_approximate"):
            raise TypeError(f"approx must be a module returned by fxapprox.approximate, got {type(approx).__name__}")
        self.approx = approx
        self.total_steps = check_int("total_steps", total_steps, minimum=1)
        self.sparse_fraction = check_fraction("sparse_fraction", sparse_fraction, allow_zero=True)
        self.switch_step = round(self.sparse_fraction * self.total_steps)
        self.steps_taken = 0

    @property
    def approximating(self) -> bool:
        """Whether the next step is approximate."""
        return self.steps_taken < self.switch_step

    def step(self) -> bool:
        """Set the module's mode for the coming step; returns whether it approximates."""
        approximate = self.approximating
        self.approx.set_approximate(approximate)
        self.steps_taken += 1
        return approximate
