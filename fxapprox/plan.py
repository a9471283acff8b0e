"""The plan: which node gets which approximation, and why the others stay exact.

Made by the budget policy (``fxapprox.passes.policy.budget_policy``) before any
rewrite, applied by the rewrite pass, shown by the report, exported as JSON.
Everything here is plain data: ``Plan.from_dict(plan.to_dict()) == plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fxapprox.row_plan import RowPlan


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
    #: the measured policy's prediction of the relative model-gradient error this layer's approximation adds
    #: (errors of different layers add in squares: ``plan.predicted_error² = Σ predicted_error²``)
    predicted_error: float | None = None
    #: exact op time / approximate op time, forward + backward, measured in isolation on the example batch
    measured_speedup: float | None = None
    #: the chosen candidate's measured relative errors: ``output``, ``input_grad``, ``weight_grad``
    measured_errors: dict | None = None
    #: every candidate the measured policy considered (method, mode, keep_ratio, flops, errors, speedup, …)
    candidates: list = field(default_factory=list)
    #: forward sampling: what the layer keeps of its input for backward, ``"reference"`` (the input itself) or
    #: ``"gathered"`` (a copy of the kept columns), and why (``fxapprox.passes.policy.input_saving``)
    save_input: str | None = None
    save_input_reason: str | None = None
    #: the relative error of the layer's own weight gradient in one draw, measured in isolation at planning (what
    #: the guard compares with the layer's error in the whole model during training)
    isolated_grad_error: float | None = None

    @property
    def keep_ratio(self) -> float:
        """Fraction of column-row pairs kept (1.0 for an exact layer)."""
        return self.k / self.n if self.approximate else 1.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["keep_ratio"] = self.keep_ratio
        return data


@dataclass(frozen=True)
class SavedValueDecision:
    """How one graph value that autograd saves for backward is stored.

    ``bits`` is 32/16 (the dtype's own width: kept as is), 8, 4 or 2 (quantised
    copy), or 1 (sign mask, when every saver only needs ``value > 0``).
    """

    node: str
    shape: list | None
    dtype: str
    exact_bytes: int
    planned_bytes: int
    bits: int
    reason: str
    savers: list = field(default_factory=list)
    aliases: list = field(default_factory=list)
    sign_exact: bool = False
    compressed: bool = False
    #: the measured memory policy's predicted model-gradient error of this value's copy
    predicted_error: float | None = None
    #: the value backward rebuilds this one from (re-running its op on that value's copy); nothing is stored
    recomputed_from: str | None = None
    #: the checkpointed block it lives in: nothing is stored, backward re-runs the block
    checkpointed_in: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BlockDecision:
    """One block the memory plan may checkpoint (``fxapprox.passes.memory.blocks``): run again in backward instead of
    keeping what it saves. Node names in graph order."""

    name: str
    nodes: list
    inputs: list
    attributes: list
    outputs: list
    #: exact bytes of the values saved only inside it (what a checkpoint frees)
    interior_bytes: int
    #: bytes of its input activations (a checkpoint keeps them, at the bits the plan gives them)
    input_bytes: int
    #: its forward, measured on the example batch: what a checkpoint adds to backward
    recompute_seconds: float
    checkpointed: bool
    reason: str
    #: bits its values are kept at while its backward runs after the re-run (``None``: as they are); then
    #: ``recompute_values`` lists ``[node, bits, sign_exact]`` for each (the node after which it is marked)
    recompute_bits: int | None = None
    recompute_values: list = field(default_factory=list)
    #: whether the plan keeps one of its inputs as a copy or rebuilds it (then it runs the reentrant checkpoint,
    #: which saves its inputs through the compressing hooks)
    inputs_copied: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan for saved activations: totals count every distinct saved tensor once."""

    memory_budget: float | None
    total_exact_bytes: int
    total_planned_bytes: int
    internal_bytes: int
    budget_met: bool
    note: str
    values: tuple[SavedValueDecision, ...] = field(default_factory=tuple)
    #: predicted model-gradient error of the chosen widths (measured memory policy only)
    predicted_error: float | None = None
    #: of ``internal_bytes``, what eager code saves in a hierarchically captured model (outside checkpointed blocks)
    eager_bytes: int = 0
    #: what the plan keeps of it (``eager_bytes`` when it is kept as it is)
    eager_planned_bytes: int = 0
    #: the bits of the copies eager code's eligible saves are kept as (``None``: kept as they are)
    eager_copy_bits: int | None = None
    #: the blocks it may checkpoint, and whether it does
    blocks: tuple[BlockDecision, ...] = field(default_factory=tuple)
    #: predicted step time / the exact step's (packing copies and re-running checkpointed blocks, measured on the
    #: example batch); ``None`` when not measured
    predicted_time: float | None = None
    #: the planned step's time / the exact step's, measured on the example batch (interleaved); ``None`` when not
    #: measured
    measured_time: float | None = None
    #: what re-running a checkpointed block holds while its backward runs (its own values, as they are or as
    #: copies), for the block where that peaks; ``total_planned_bytes`` is the peak: what is kept up to that block
    #: plus this, or everything kept, whichever is larger
    recompute_bytes: int = 0

    @property
    def achieved(self) -> float:
        """Planned saved bytes as a fraction of the exact model's."""
        return self.total_planned_bytes / self.total_exact_bytes if self.total_exact_bytes else 1.0

    @property
    def compressed(self) -> tuple[SavedValueDecision, ...]:
        return tuple(v for v in self.values if v.compressed)

    @property
    def recomputed(self) -> tuple[SavedValueDecision, ...]:
        return tuple(v for v in self.values if v.recomputed_from is not None)

    @property
    def checkpointed(self) -> tuple[BlockDecision, ...]:
        return tuple(b for b in self.blocks if b.checkpointed)

    def to_dict(self) -> dict:
        return {"memory_budget": self.memory_budget, "total_exact_bytes": self.total_exact_bytes,
                "total_planned_bytes": self.total_planned_bytes, "internal_bytes": self.internal_bytes,
                "achieved": self.achieved, "budget_met": self.budget_met, "note": self.note,
                "values": [v.to_dict() for v in self.values], "predicted_error": self.predicted_error,
                "eager_bytes": self.eager_bytes, "eager_planned_bytes": self.eager_planned_bytes,
                "eager_copy_bits": self.eager_copy_bits, "blocks": [b.to_dict() for b in self.blocks],
                "predicted_time": self.predicted_time, "measured_time": self.measured_time,
                "recompute_bytes": self.recompute_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryPlan":
        values = tuple(SavedValueDecision(**v) for v in data["values"])
        fields = {k: data[k] for k in ("memory_budget", "total_exact_bytes", "total_planned_bytes",
                                       "internal_bytes", "budget_met", "note")}
        blocks = tuple(BlockDecision(**b) for b in data.get("blocks", ()))
        return cls(values=values, predicted_error=data.get("predicted_error"), eager_bytes=data.get("eager_bytes", 0),
                   eager_planned_bytes=data.get("eager_planned_bytes", data.get("eager_bytes", 0)),
                   eager_copy_bits=data.get("eager_copy_bits"),
                   blocks=blocks, predicted_time=data.get("predicted_time"),
                   measured_time=data.get("measured_time"), recompute_bytes=data.get("recompute_bytes", 0),
                   **fields)


def reason_key(reason: str) -> str:
    """What layers with the same reason share: the reason up to its first parenthesis (``"no candidate measured
    faster than exact (best 0.52x < …)"`` → ``"no candidate measured faster than exact"``)."""
    return reason.split(" (", 1)[0]


def exact_reason_groups(decisions) -> list[tuple[str, list]]:
    """``[(reason, [decisions])]`` of the exact layers among ``decisions``, grouped by :func:`reason_key`, largest
    group first; a group whose members' reasons differ beyond the key shows the key only."""
    groups: dict[str, list] = {}
    for decision in decisions:
        if not decision.approximate:
            groups.setdefault(reason_key(decision.reason), []).append(decision)
    result = []
    for key, members in groups.items():
        reasons = {d.reason for d in members}
        result.append((members[0].reason if len(reasons) == 1 else key, members))
    return sorted(result, key=lambda group: -len(group[1]))


@dataclass(frozen=True)
class Plan:
    """The whole plan and its totals (training FLOPs are forward + backward)."""

    #: the FLOP budget asked for (a fraction of exact training FLOPs), or ``"auto"``
    budget: float | str
    method: str
    total_exact_flops: int
    total_planned_flops: int
    budget_met: bool
    note: str
    layers: tuple[LayerDecision, ...] = field(default_factory=tuple)
    config: dict = field(default_factory=dict)
    memory: MemoryPlan | None = None
    #: the measured policy's predicted relative error of the model's gradient (``None`` for other policies)
    predicted_error: float | None = None
    #: submodules torch.fx could not trace, kept whole and exact: dicts with ``module``, ``module_type``,
    #: ``reason`` and ``source_line``
    untraced: tuple[dict, ...] = field(default_factory=tuple)
    #: the predicted model-gradient error of one training step, the noise of one draw counted whole (what the
    #: guard, ``ApproxConfig(check_every=N)``, measures); ``predicted_error`` averages the noise over steps
    predicted_step_error: float | None = None
    #: the measured policy's pay-off model (``fxapprox.passes.policy.payoff``): predicted exact / approximate step time,
    #: and how much sooner than exact training the plan reaches a given loss (speed-up / predicted steps)
    predicted_speedup: float | None = None
    predicted_gain: float | None = None
    #: for a model whose own code torch.fx cannot trace, how each part runs (hierarchical capture): dicts with
    #: ``path``, ``kind`` ("traced", "leaf" — swapped in place —, "eager"), ``module_type``, ``reason``,
    #: ``source_line``; empty for a model traced whole
    regions: tuple[dict, ...] = field(default_factory=tuple)
    #: the pay-off model's predicted steps to a given loss, as a multiple of exact training's
    predicted_steps: float | None = None
    #: a numeric budget: what ``budget="auto"`` would plan instead, in one phrase (the pay-off model advises)
    auto_advice: str | None = None
    #: what the user should know before trusting the plan (a budget spent past ``max_grad_error``, layers sampled
    #: although measured slower, a budget out of reach)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    #: the least fraction of exact training FLOPs the model's candidates reach (measured policy)
    lowest_reachable: float | None = None
    #: exact ÷ planned step time (forward + backward) measured on the example batch after the rewrite, paired in
    #: interleaved rounds (measured policy with timing on); ``predicted_speedup`` adds up the layers' isolated
    #: timings instead
    measured_speedup: float | None = None
    #: the plan run on the example batch against exact training (``passes/guard/check_plan.py``): measured and predicted
    #: one-step errors, the measured ÷ predicted factors, the factors the plan was made with and its re-plans
    check: dict | None = None
    #: the schedule the plan runs under over training (``fxapprox.schedule.ScheduleRecord.to_dict``): its kind,
    #: total steps, exact tail and the whole run's predicted FLOPs; ``None``: every step at full strength
    schedule: dict | None = None
    #: the row family (blocks whose backward keeps a share of the batch's samples), ``None`` when it is not used
    rows: RowPlan | None = None

    @property
    def achieved(self) -> float:
        """Planned training FLOPs as a fraction of the exact model's."""
        return self.total_planned_flops / self.total_exact_flops if self.total_exact_flops else 1.0

    @property
    def approximated(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if d.approximate)

    def with_check(self, check, calibration, replans: int) -> "Plan":
        """This plan with what its check on the example batch measured (``passes/check_plan.PlanCheck``), the
        factors it was made with (``calibration``, ``None``: as predicted) and the re-plans the check asked for;
        a warning where the measured model-gradient error passes ``divergence_error``."""
        import dataclasses

        record = {**check.to_dict(), "calibration": None if calibration is None else dataclasses.asdict(calibration),
                  "replans": replans}
        warnings = self.warnings
        limit = self.config.get("divergence_error")
        if limit is not None and check.calibrated_error > limit:
            warnings += (f"on the example batch the plan's calibrated model-gradient error is "
                         f"{check.calibrated_error:.3g} > divergence_error={limit:g} (one step: "
                         f"{check.model_error:.3g}): its gradient is farther from the exact one than the exact one is "
                         f"from zero, and the guard will re-plan",)
        return dataclasses.replace(self, check=record, warnings=warnings)

    def with_measured_speedup(self, speedup: float) -> "Plan":
        """This plan with its step speed-up as measured on the example batch (the note says it too)."""
        import dataclasses

        note = f"{self.note}; measured on the example batch: {speedup:.2f}x faster per step"
        return dataclasses.replace(self, measured_speedup=speedup, note=note)

    def fingerprint(self) -> str:
        """A short hash of what the plan does: the budget and, per layer, whether and how it is sampled (method,
        mode, kept pairs) and what it keeps of its input. Two plans with the same fingerprint rewrite the model
        the same way; predictions and timings are left out."""
        import hashlib
        import json

        decisions = [(d.node, d.approximate, d.method, d.mode, d.k, d.n, d.save_input) for d in self.layers]
        memory = None if self.memory is None else [(v.node, v.bits, v.recomputed_from) for v in self.memory.values]
        schedule = None if self.schedule is None else [self.schedule.get(k) for k in ("kind", "total_steps",
                                                                                     "exact_fraction")]
        rows = None if self.rows is None else [self.rows.token_ratio] + [(b.name, b.ratio) for b in self.rows.blocks]
        text = json.dumps([self.budget, decisions, memory] + ([schedule] if schedule else [])
                          + ([rows] if rows else []), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

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
            "memory": None if self.memory is None else self.memory.to_dict(),
            "predicted_error": self.predicted_error,
            "predicted_step_error": self.predicted_step_error,
            "predicted_speedup": self.predicted_speedup,
            "predicted_gain": self.predicted_gain,
            "untraced": [dict(u) for u in self.untraced],
            "regions": [dict(r) for r in self.regions],
            "predicted_steps": self.predicted_steps,
            "auto_advice": self.auto_advice,
            "warnings": list(self.warnings),
            "lowest_reachable": self.lowest_reachable,
            "measured_speedup": self.measured_speedup,
            "check": self.check,
            "schedule": self.schedule,
            "rows": None if self.rows is None else self.rows.to_dict(),
            "fingerprint": self.fingerprint(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        layers = tuple(
            LayerDecision(**{k: v for k, v in layer.items() if k != "keep_ratio"}) for layer in data["layers"]
        )
        fields = {k: data[k] for k in ("budget", "method", "total_exact_flops", "total_planned_flops",
                                       "budget_met", "note", "config")}
        memory = data.get("memory")
        return cls(layers=layers, memory=None if memory is None else MemoryPlan.from_dict(memory),
                   predicted_error=data.get("predicted_error"), predicted_step_error=data.get("predicted_step_error"),
                   predicted_speedup=data.get("predicted_speedup"), predicted_gain=data.get("predicted_gain"),
                   untraced=tuple(dict(u) for u in data.get("untraced", ())),
                   regions=tuple(dict(r) for r in data.get("regions", ())),
                   predicted_steps=data.get("predicted_steps"), auto_advice=data.get("auto_advice"),
                   warnings=tuple(data.get("warnings", ())), lowest_reachable=data.get("lowest_reachable"),
                   measured_speedup=data.get("measured_speedup"), check=data.get("check"),
                   schedule=data.get("schedule"),
                   rows=None if data.get("rows") is None else RowPlan.from_dict(data["rows"]), **fields)
