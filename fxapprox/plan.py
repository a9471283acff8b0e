"""The plan: which node gets which approximation, and why the others stay exact.

Made by the budget policy (``fxapprox.passes.budget_policy``) before any
rewrite, applied by the rewrite pass, shown by the report, exported as JSON.
Everything here is plain data: ``Plan.from_dict(plan.to_dict()) == plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerDecision:
    """The decision for one layer (a graph node that does FLOPs)."""

    node: str
    target: str
    op_kind: str | None
    shape: list | None
    in_channels: int | None
    out_channels: int | None
    exact_flops: int
    planned_flops: int
    approximate: bool
    reason: str
    method: str | None = None
    mode: str | None = None
    k: int | None = None
    n: int | None = None
    random_share: float = 0.0
    rank: int | None = None
    saved_bytes: int = 0

    @property
    def keep_ratio(self) -> float:
        """Fraction of column-row pairs kept (1.0 for an exact layer)."""
        return self.k / self.n if self.approximate else 1.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["keep_ratio"] = self.keep_ratio
        return data


@dataclass(frozen=True)
class Plan:
    """The whole plan and its totals (training FLOPs are forward + backward)."""

    budget: float
    method: str
    total_exact_flops: int
    total_planned_flops: int
    budget_met: bool
    note: str
    layers: tuple[LayerDecision, ...] = field(default_factory=tuple)
    config: dict = field(default_factory=dict)

    @property
    def achieved(self) -> float:
        """Planned training FLOPs as a fraction of the exact model's."""
        return self.total_planned_flops / self.total_exact_flops if self.total_exact_flops else 1.0

    @property
    def approximated(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if d.approximate)

    def decision(self, node_name: str) -> LayerDecision:
        for decision in self.layers:
            if decision.node == node_name:
                return decision
        raise KeyError(f"no layer named {node_name!r} in the plan")

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "method": self.method,
            "total_exact_flops": self.total_exact_flops,
            "total_planned_flops": self.total_planned_flops,
            "achieved": self.achieved,
            "budget_met": self.budget_met,
            "note": self.note,
            "config": self.config,
            "layers": [d.to_dict() for d in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        layers = tuple(
            LayerDecision(**{k: v for k, v in layer.items() if k != "keep_ratio"}) for layer in data["layers"]
        )
        fields = {k: data[k] for k in ("budget", "method", "total_exact_flops", "total_planned_flops",
                                       "budget_met", "note", "config")}
        return cls(layers=layers, **fields)
