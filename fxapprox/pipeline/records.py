"""Where the passes keep their results: one typed record per pass, each under its own ``node.meta`` key.

This is how torch's ``ShapeProp`` keeps a ``TensorMetadata`` under ``node.meta["tensor_meta"]``. Records are
frozen: a pass writes its record, and a later pass that refines one (the measurement adds measured errors to the
candidates) writes a new record with :func:`dataclasses.replace`, so a copy of a graph (whose nodes share their
``meta`` values) never sees another copy's later passes. The accessors below read them: ``tensor_of``, ``kind_of``,
``flops_of`` and ``saved_of`` return an empty record for a node their pass did not annotate, the others ``None``.

=====================  ==========================  =========================================================
``node.meta`` key      record                      written by
=====================  ==========================  =========================================================
``TENSOR_KEY``         :class:`TensorSummary`      ``shape_prop``
``KIND_KEY``           :class:`LayerKind`          ``channels`` (the op-kind registry's match)
``FLOPS_KEY``          :class:`FlopCount`          ``flops`` (and, for eager code, ``fxapprox.pipeline.eager``)
``SAVED_KEY``          :class:`SavedTensors`       ``saved_bytes``
``NORMS_KEY``          :class:`ActivationNorms`    ``_upstream`` / ``measure_candidates`` / ``measure_saved``
``RANK_KEY``           :class:`LayerRank`          ``rank``
``CANDIDATES_KEY``     :class:`LayerCandidates`    ``candidates``; measured by ``measure_candidates``,
                                                   predicted by the measured budget policy
``DECISION_KEY``       :class:`PlannedLayer`       the budget policies, re-plans, ``fxapprox.pipeline.ranks``
``BIT_ERRORS_KEY``     ``{bits: {...}}``           ``measure_saved``
``EAGER_SAVED_KEY``    ``int`` (bytes)             ``fxapprox.pipeline.eager``: what a stitched node's eager code saves
``EAGER_COPY_KEY``     ``int`` (bytes)             ``fxapprox.pipeline.eager``: the same kept as copies
``EAGER_REASON_KEY``   ``str``                     ``stitch``: why a stitched node runs eagerly
=====================  ==========================  =========================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch.fx

TENSOR_KEY = "fxapprox_tensor"
KIND_KEY = "fxapprox_kind"
FLOPS_KEY = "fxapprox_flops"
SAVED_KEY = "fxapprox_saved"
NORMS_KEY = "fxapprox_norms"
RANK_KEY = "fxapprox_rank"
CANDIDATES_KEY = "fxapprox_candidates"
DECISION_KEY = "fxapprox_decision"
BIT_ERRORS_KEY = "fxapprox_bit_errors"
EAGER_SAVED_KEY = "fxapprox_eager_saved_bytes"
EAGER_COPY_KEY = "fxapprox_eager_copy_bytes"
EAGER_REASON_KEY = "fxapprox_eager_reason"
#: ``node.meta`` key (True) of a node that is not the model's own (the stitched planning graph's loss): the
#: per-node analyses leave it out
OUTSIDE_MODEL_KEY = "fxapprox_outside_model"
#: ``node.meta`` key (True) of a placeholder of a stitched planning graph whose value's gradient flows on into code
#: outside the graph (a region's input that requires grad): the error policies' propagation counts it
UPSTREAM_OUTSIDE_KEY = "fxapprox_upstream_outside"
#: ``node.meta`` key (True) of a region's output in a stitched planning graph that the model's code reads on
#: (parameterised code downstream, outside the graph): the region's last layers are not the model's output layers
DOWNSTREAM_OUTSIDE_KEY = "fxapprox_downstream_outside"
#: ``node.meta`` key of a placeholder of a stitched planning graph: the name of an earlier placeholder holding the
#: same tensor (two regions read it); the memory policy treats it as an alias
SAME_TENSOR_KEY = "fxapprox_same_tensor_as"


@dataclass(frozen=True)
class TensorSummary:
    """A node's output: ``shape`` (a list, or a list of lists for several outputs) and ``dtype`` (``"float32"``)."""

    shape: list | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class LayerKind:
    """What a node computes, as the op-kind registry matched it (``fxapprox.op_kinds.registry``).

    ``op_kind`` names a registered kind (``approximable``), a recognised kind without an approximate version
    (``"gru"``; an activation @ activation ``"matmul"``; ``unsupported`` says why it stays exact), or is ``None``;
    ``reduction_size`` is the number of column-row pairs a sampled version chooses from. What a registered kind's
    ``match`` returns beyond these fields is kept in ``extra``.
    """

    op_kind: str | None = None
    approximable: bool = False
    module_type: str | None = None
    in_channels: int | None = None
    out_channels: int | None = None
    groups: int | None = None
    reduction_size: int | None = None
    kernel_size: list | None = None
    padding_mode: str | None = None
    parameter_operand: bool | None = None
    parameter_side: str | None = None
    numeric_padding: bool = True
    weight_requires_grad: bool = True
    unsupported: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain data: the kind and what its match found (the two flags only where a registered kind matched)."""
        data = {"op_kind": self.op_kind, "approximable": self.approximable}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag_of_no_match = f.name in ("numeric_padding", "weight_requires_grad") and not self.approximable
            if f.name not in data and f.name != "extra" and value is not None and not flag_of_no_match:
                data[f.name] = value
        return {**data, **self.extra}

    @classmethod
    def from_match(cls, info: dict) -> "LayerKind":
        """The record of a match's info dict (``fxapprox.op_kinds.registry.match_node``)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in info.items() if k in names},
                   extra={k: v for k, v in info.items() if k not in names})


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one training step of a node: its forward and its backward."""

    forward: int = 0
    backward: int = 0

    @property
    def train(self) -> int:
        return self.forward + self.backward


@dataclass(frozen=True)
class SavedTensors:
    """What a node makes autograd keep for backward (see ``passes/analysis/saved_bytes.py``)."""

    bytes: int = 0
    tensors: int = 0
    #: ``{graph value name: bytes}`` — graph values saved as they are
    saved_from: dict = field(default_factory=dict)
    #: ``{graph value name: bytes}`` — copies a sampled op derives from that value and saves
    saved_derived: dict = field(default_factory=dict)
    #: temporaries that are no graph value (batch statistics, dropout masks); ``internal_bool_bytes`` are boolean
    internal_bytes: int = 0
    internal_bool_bytes: int = 0
    #: the input whose storage the node's output shares (a view or an in-place op), and whether it wrote it
    alias_of: str | None = None
    inplace: bool = False


@dataclass(frozen=True)
class ActivationNorms:
    """Norms measured on the example batch: of a node's input, output, output gradient and input gradient (the
    upstream capture writes the first three, the measurement passes the input gradient)."""

    input: float | None = None
    output: float | None = None
    output_grad: float | None = None
    input_grad: float | None = None


@dataclass(frozen=True)
class LayerRank:
    """A layer's rank among the approximable layers (1 = most worth sampling) and the score behind it."""

    rank: int
    score: float


@dataclass(frozen=True)
class Candidate:
    """One way to approximate a layer: ``method`` in ``mode`` keeping ``k`` of ``n`` pairs.

    Three groups of fields, each filled by one stage: what it is and costs (the candidates pass; ``blocked`` says
    why it does not fit the layer), what it measured (``measure_candidates``: effective ``errors``, their
    ``bias`` and ``noise``, ``seconds`` and ``speedup``), and what the measured policy predicts from those
    (``contribution`` to the squared model-gradient error, ``step_cost``, ``saving`` in FLOPs, ``time_saving``
    in seconds; a re-plan keeps the uncalibrated predictions in the ``raw_`` fields).
    """

    method: str
    mode: str
    keep_ratio: float
    k: int
    n: int
    flops: int
    blocked: str | None = None
    # measured
    errors: dict | None = None
    bias: dict | None = None
    noise: dict | None = None
    seconds: float | None = None
    speedup: float | None = None
    # predicted
    contribution: float | None = None
    predicted_error: float | None = None
    step_contribution: float | None = None
    step_cost: float | None = None
    saving: float | None = None
    time_saving: float | None = None
    #: predicted change of the time to a given loss, as a fraction of exact training's: extra steps less the share of
    #: the step's time saved (negative: the candidate pays); what a numeric budget's walk minimises per FLOP saved
    net_cost: float | None = None
    interpolated: bool = False
    raw_contribution: float | None = None
    raw_step_contribution: float | None = None
    raw_step_cost: float | None = None

    @property
    def measured(self) -> bool:
        return self.errors is not None

    def to_dict(self) -> dict:
        """Plain data (the export's view): what it is, what it measured once measured, the predictions made."""
        data = dataclasses.asdict(self)
        kept = ["method", "mode", "keep_ratio", "k", "n", "flops", "blocked"]
        if self.measured:
            kept += ["errors", "bias", "noise", "seconds", "speedup"]
        kept += [k for k in _PREDICTED if data[k] is not None] + (["interpolated"] if self.interpolated else [])
        return {k: data[k] for k in kept}


_PREDICTED = ("contribution", "predicted_error", "step_contribution", "step_cost", "saving", "time_saving", "net_cost",
              "raw_contribution", "raw_step_contribution", "raw_step_cost")


@dataclass(frozen=True)
class LayerCandidates:
    """The candidates pass's result for one planned layer.

    ``blocker``: why it stays exact whatever the budget, or ``None``; ``allowed_methods`` / ``allowed_modes``:
    what its candidates may use; ``requested_method``: the ``method=`` argument or an override's;
    ``pinned_ratio``: a keep-ratio an override fixed (``pinned_by`` names the override); ``exact_seconds``: the
    exact op's measured time (``measure_candidates``).
    """

    blocker: str | None = None
    allowed_methods: tuple[str, ...] = ()
    allowed_modes: tuple[str, ...] = ()
    requested_method: str | None = None
    pinned_ratio: float | None = None
    pinned_by: str | None = None
    candidates: tuple[Candidate, ...] = ()
    exact_seconds: float | None = None

    def to_dict(self) -> dict:
        """Plain data (the export's view): the fields that are set, ``blocker`` and ``pinned_ratio`` always."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "candidates"}
        data = {k: v for k, v in data.items() if v is not None or k in ("blocker", "pinned_ratio")}
        return {**data, "candidates": [c.to_dict() for c in self.candidates]}


@dataclass(frozen=True)
class PlannedLayer:
    """A layer's decision in the current plan and the candidate behind it (``None``: exact); a re-plan and the DDP
    rank agreement write a new one."""

    decision: Any   # fxapprox.plan.LayerDecision
    chosen: Candidate | None = None


# -- accessors ---------------------------------------------------------------------------------------------------
_EMPTY_TENSOR, _EMPTY_KIND, _NO_FLOPS, _NOTHING_SAVED = TensorSummary(), LayerKind(), FlopCount(), SavedTensors()


def tensor_of(node: torch.fx.Node) -> TensorSummary:
    return node.meta.get(TENSOR_KEY, _EMPTY_TENSOR)


def kind_of(node: torch.fx.Node) -> LayerKind:
    return node.meta.get(KIND_KEY, _EMPTY_KIND)


def flops_of(node: torch.fx.Node) -> FlopCount:
    return node.meta.get(FLOPS_KEY, _NO_FLOPS)


def train_flops(node: torch.fx.Node) -> int:
    """Forward + backward FLOPs of ``node`` measured by the flops pass (0 if none)."""
    return flops_of(node).train


def saved_of(node: torch.fx.Node) -> SavedTensors:
    return node.meta.get(SAVED_KEY, _NOTHING_SAVED)


def norms_of(node: torch.fx.Node) -> ActivationNorms | None:
    return node.meta.get(NORMS_KEY)


def write_norms(node: torch.fx.Node, **norms: float | None) -> None:
    """Record some of ``node``'s measured norms (a new record with these changed)."""
    node.meta[NORMS_KEY] = dataclasses.replace(node.meta.get(NORMS_KEY, ActivationNorms()), **norms)


def rank_of(node: torch.fx.Node) -> LayerRank | None:
    return node.meta.get(RANK_KEY)


def candidates_of(node: torch.fx.Node) -> LayerCandidates | None:
    return node.meta.get(CANDIDATES_KEY)


def decision_of(node: torch.fx.Node) -> PlannedLayer | None:
    return node.meta.get(DECISION_KEY)


def chosen_of(node: torch.fx.Node) -> Candidate | None:
    planned = decision_of(node)
    return None if planned is None else planned.chosen


def node_summary(node: torch.fx.Node) -> dict:
    """Every fxapprox record of ``node`` as one flat dict of plain values (what ``fxapprox.export`` and
    ``graph_view.to_networkx`` attach to a node)."""
    summary: dict = {}
    if TENSOR_KEY in node.meta:
        summary.update(dataclasses.asdict(tensor_of(node)))
    if KIND_KEY in node.meta:
        summary.update(kind_of(node).to_dict())
    if FLOPS_KEY in node.meta:
        summary.update(flops_fwd=flops_of(node).forward, flops_bwd=flops_of(node).backward)
    if SAVED_KEY in node.meta:
        saved = saved_of(node)
        summary.update(saved_bytes=saved.bytes, saved_tensors=saved.tensors, saved_from=saved.saved_from,
                       saved_derived=saved.saved_derived, saved_internal_bytes=saved.internal_bytes,
                       saved_internal_bool_bytes=saved.internal_bool_bytes, alias_of=saved.alias_of,
                       inplace=saved.inplace)
    if NORMS_KEY in node.meta:
        summary["norms"] = dataclasses.asdict(norms_of(node))
    if RANK_KEY in node.meta:
        summary.update(rank=rank_of(node).rank, rank_score=rank_of(node).score)
    if CANDIDATES_KEY in node.meta:
        summary.update(candidates_of(node).to_dict())
    if DECISION_KEY in node.meta:
        planned = decision_of(node)
        summary["plan"] = planned.decision.to_dict()
        summary["chosen"] = None if planned.chosen is None else planned.chosen.to_dict()
    for key, name in ((BIT_ERRORS_KEY, "bit_errors"), (EAGER_SAVED_KEY, "eager_saved_bytes"),
                      (EAGER_COPY_KEY, "eager_copy_bytes"), (EAGER_REASON_KEY, "eager_reason")):
        if key in node.meta:
            summary[name] = node.meta[key]
    return summary
