"""The row family's part of a plan (``Plan.rows``): plain data, like the rest of :mod:`fxapprox.plan`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["RowBlockDecision", "RowPlan"]


@dataclass(frozen=True)
class RowBlockDecision:
    """One block of the row family (``fxapprox.ops.rows``): the share of the batch's samples its backward keeps."""

    name: str
    layers: list
    exact_flops: int
    planned_flops: int
    #: keep-ratio over the batch's samples (1.0: every sample, the block's backward exact)
    ratio: float
    sampled: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RowPlan:
    """The row family's part of a plan: which blocks sample the rows of their backward, how many, and what the
    variance measured on the last check says (``fxapprox.passes.policy.row_policy``)."""

    blocks: tuple[RowBlockDecision, ...]
    #: share of a kept sample's tokens each linear layer's weight gradient keeps (1.0: all)
    token_ratio: float
    #: ``budget="auto"``: the sampling variance is held at most ``tau`` × the minibatch's (SGD) variance; ``None``
    #: for a numeric budget (its FLOPs are spent, the variance measured and reported)
    tau: float | None
    note: str
    #: the last variance check (``None`` before one ran): the minibatch's gradient variance and the sampling's
    #: (rows and tokens), both over the sampled blocks' parameters, and the gradient noise scale B_noise / B
    sgd_variance: float | None = None
    row_variance: float | None = None
    token_variance: float | None = None
    noise_scale: float | None = None
    #: the token ratio below which sampling a weight gradient's tokens is faster than computing it whole, measured on
    #: this machine at the blocks' largest linear layer (``None``: not measured); a higher token ratio is not used
    token_breakeven: float | None = None
    #: the keep-ratio below which replaying a block on its kept rows costs fewer FLOPs than running it whole (the
    #: replay repeats its cheap ops' forward); a higher keep-ratio is not used
    row_breakeven: float | None = None
    #: a numeric budget: the ``[token ratio, keep-ratio]`` pairs that spend it, among which the first variance check
    #: takes the one of least measured variance
    options: tuple = ()
    #: the step of the last check, and the ratios it measured at (under ``budget="auto"`` a probe, where the plan's
    #: ratio was 1)
    checked_step: int | None = None
    checked_ratio: float | None = None
    checked_token_ratio: float | None = None
    #: steps from the last check to the next (``row_check_every``; doubled after each ``"auto"`` check that found
    #: nothing to sample within its bound)
    check_interval: int | None = None

    @property
    def sampled(self) -> tuple[RowBlockDecision, ...]:
        return tuple(b for b in self.blocks if b.sampled)

    @property
    def saved_flops(self) -> int:
        return sum(b.exact_flops - b.planned_flops for b in self.blocks)

    @property
    def variance_ratio(self) -> float | None:
        """The sampling variance ÷ the minibatch's, as last measured."""
        if self.sgd_variance is None or self.row_variance is None or not self.sgd_variance:
            return None
        return (self.row_variance + (self.token_variance or 0.0)) / self.sgd_variance

    def to_dict(self) -> dict:
        data = asdict(self)
        data["blocks"] = [b.to_dict() for b in self.blocks]
        data["variance_ratio"] = self.variance_ratio
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "RowPlan":
        fields = {k: v for k, v in data.items() if k not in ("blocks", "variance_ratio", "options")}
        return cls(blocks=tuple(RowBlockDecision(**b) for b in data["blocks"]),
                   options=tuple(tuple(o) for o in data.get("options", ())), **fields)
