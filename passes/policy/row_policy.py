"""Pass 4c, the row family's policy: which blocks sample the rows of their backward, and how many.

The row family (``fxapprox.ops.rows``) keeps the forward exact and samples the gradient along the data: each
block's backward runs on a share ``ratio`` of the batch's samples (chosen by their gradient norms, rescaled:
unbiased), and each linear layer's weight gradient on ``token_ratio`` of their tokens. What it adds is variance,
which can be set against the variance the minibatch already carries (SGD's): the variance checks
(``fxapprox.runtime.row_blocks``) measure both over the sampled blocks' parameters, on the first training step
(whose loss is the user's) and every ``ApproxConfig.row_check_every`` steps after.

* A **numeric budget** is spent: the blocks' keep-ratio is set so the step executes that fraction of exact training
  FLOPs (:func:`ratio_for_budget`), at the token ratio (of ``ApproxConfig.token_ratios``, those below the measured
  break-even where sampling tokens is faster than the whole weight gradient) whose measured variance is least for it
  (:func:`choose_for_budget`, on the first step). When even the fewest rows cannot reach the budget the plan is not
  a row plan: the other families spend it (the note says why).
* **``budget="auto"``** holds each part of the sampling variance (rows; tokens) at ``variance_tau`` × the SGD
  variance: each is modelled as ``c · (1/r − 1)`` in its ratio ``r`` (PPS sampling of near-equal norms; skewed norms
  do better, so the model errs on the side of keeping more), ``c`` fitted to the last measurement, and the ratio set
  where the model meets the bound (:func:`next_ratios`), half-way in log from the old ratio (the measurement is one
  batch's). A keep-ratio above its break-even (replaying the block costs more FLOPs than the dropped rows save) or a
  token ratio above its measured break-even becomes 1: what does not save is not sampled.

Every block gets the same keep-ratio: the rows it keeps are kept by every block below it (they keep a subset of
what is left, never more), so the sampling happens once at the top block and each block's backward shrinks alike;
with near-equal per-sample norms a row costs every block the same variance per FLOP it saves.
"""

from __future__ import annotations

import dataclasses
import math

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.op_kinds.registry import handler_for
from fxapprox.passes.analysis.row_blocks import RowBlock, row_blocks_of
from fxapprox.passes.measurement.candidates import planned_layers
from fxapprox.passes.policy.policy_types import Choice
from fxapprox.pipeline.records import Candidate, candidates_of, flops_of, kind_of, train_flops
from fxapprox.row_plan import RowBlockDecision, RowPlan
from fxapprox.runtime.modules import ROWS

__all__ = ["MIN_RATIO", "PROBE_RATIO", "choose_for_budget", "eligible_row_blocks", "next_ratios", "probe_setting",
           "ratio_for_budget", "row_choices", "row_plan", "with_ratios"]

#: the fewest samples a row plan keeps, as a share of the batch (below it the estimate is mostly noise)
MIN_RATIO = 0.05


def eligible_row_blocks(gm: torch.fx.GraphModule) -> list[RowBlock]:
    """The row blocks of ``gm`` that can be row-sampled and all of whose layers may be approximated."""
    blocks = []
    by_name = {n.name: n for n in gm.graph.nodes}
    for block in row_blocks_of(gm):
        if block.blocker is not None or not block.layers:
            continue
        layers = [by_name[name] for name in block.layers]
        if any((candidates_of(n) is not None and candidates_of(n).blocker is not None) for n in layers):
            continue
        blocks.append(block)
    return blocks


def ratio_for_budget(blocks: list[RowBlock], total: float, budget: float, token_ratio: float) -> float | None:
    """The keep-ratio at which the step executes ``budget`` of ``total`` FLOPs with ``token_ratio`` of the kept
    samples' tokens in the weight gradients (``None``: below :data:`MIN_RATIO`). A block's FLOPs are
    ``fixed + ratio · scaled(token_ratio)`` (:meth:`RowBlock.flops`), so the ratio is one division."""
    target_saving = total * (1.0 - budget)
    most = sum(b.exact_flops - b.flops(0.0, token_ratio) for b in blocks)          # saved when no row is kept
    scaled = sum(b.per_ratio(token_ratio) for b in blocks)
    if scaled <= 0 or most < target_saving:
        return None
    ratio = (most - target_saving) / scaled
    if ratio >= min(b.breakeven(token_ratio) for b in blocks):
        # the budget needs fewer rows dropped than the replay costs: rows whole, the tokens alone may meet it
        whole = sum(b.exact_flops - b.flops(1.0, token_ratio) for b in blocks)
        return 1.0 if whole >= target_saving else None
    return ratio if ratio >= MIN_RATIO else None


#: where ``budget="auto"`` measures a ratio it has no variance for yet (it samples nothing there)
PROBE_RATIO = 0.5


def probe_setting(rows: RowPlan, ratio: float, token_ratio: float) -> tuple[dict, float]:
    """The ``(ratios by block, token ratio)`` a check measures: the plan's; under ``budget="auto"`` a ratio that
    samples little (above ``1 − PROBE_RATIO / 4``: a few percent of a batch, whose variance one batch measures
    poorly) is measured at :data:`PROBE_RATIO` instead (its variance model needs a well-sampled point)."""
    if rows.tau is not None:
        ratio = ratio if ratio <= 1.0 - PROBE_RATIO / 4 else PROBE_RATIO
        token_ratio = token_ratio if token_ratio <= 1.0 - PROBE_RATIO / 4 else PROBE_RATIO
    return {b.name: ratio for b in rows.sampled}, token_ratio


def _target(measured_at: float, part: float, tau: float, floor: float, current: float) -> float:
    """The ratio at which the model ``c · (1/r − 1)``, fitted to ``part`` (variance ÷ SGD's) at ``measured_at``,
    meets ``tau`` (``current`` where the measurement holds no information: nothing was sampled)."""
    if measured_at >= 1.0 or part <= 0.0:
        return current
    spread = part / (1.0 / measured_at - 1.0)
    return min(1.0, max(floor, 1.0 / (1.0 + tau / spread)))


def next_ratios(ratio: float, token_ratio: float, check, tau: float, config: ApproxConfig, calibrating: bool,
                breakeven: float = 1.0, token_breakeven: float = 1.0) -> tuple[float, float]:
    """``budget="auto"``'s next ``(ratio, token_ratio)`` from a check measured at :func:`probe_setting`'s ratios
    (see the module docstring): the targets where each part's variance model meets ``tau``, reached half-way in log
    from the current ratios (at once when ``calibrating``, on the first step). A keep-ratio above ``breakeven`` (where
    the replay costs more than the dropped rows save) becomes 1: the blocks run whole, only their weight gradients
    sampled; a token ratio above ``token_breakeven`` (where sampling the tokens costs more time than it saves)
    becomes 1."""
    token_floor = min(config.token_ratios)
    targets = (_target(check.ratio, check.row_part, tau, MIN_RATIO, ratio),
               _target(check.token_ratio, check.token_part, tau, token_floor, token_ratio)
               if token_floor < 1.0 else 1.0)
    if calibrating:
        moved = targets
    else:
        moved = tuple(math.exp(0.5 * (math.log(current) + math.log(target)))
                      for current, target in zip((ratio, token_ratio), targets))
    rows, tokens = (round(value, 4) for value in moved)
    return (1.0 if rows > breakeven else rows), (1.0 if tokens > token_breakeven else tokens)


def choose_for_budget(options: dict[float, tuple[float, float]]) -> float:
    """The token ratio of the least measured variance: ``options`` maps token ratio → ``(keep-ratio, measured
    sampling variance)`` at the budget."""
    return min(options, key=lambda token: (options[token][1], -token))


def _row_candidate(node: torch.fx.Node, ratio: float, token_ratio: float) -> Candidate:
    count = flops_of(node)
    weight = handler_for(node).weight_grad_flops(node)
    flops = count.forward + ratio * (max(0, count.backward - weight) + token_ratio * weight)
    n = kind_of(node).reduction_size or 1
    return Candidate(method="pps", mode=ROWS, keep_ratio=token_ratio, k=max(1, min(n, round(token_ratio * n))), n=n,
                     flops=int(flops))


def row_choices(gm: torch.fx.GraphModule, blocks: list[RowBlock], ratio: float, token_ratio: float) -> dict:
    """``{node: Choice}`` for every planned layer: a block's layers row-sampled, the others exact."""
    member = {name: block for block in blocks for name in block.layers}
    choices = {}
    for node in planned_layers(gm):
        block = member.get(node.name)
        if block is not None:
            choices[node] = Choice(_row_candidate(node, ratio, token_ratio),
                                   f"row-sampled block {block.name}: backward on {ratio:.0%} of the samples")
        else:
            layer = candidates_of(node)
            reason = layer.blocker if layer is not None and layer.blocker else "outside the row-sampled blocks"
            choices[node] = Choice(None, reason)
    return choices


def _block_decisions(blocks_all: list[RowBlock], sampled: list[RowBlock], ratio: float,
                     token_ratio: float) -> tuple[RowBlockDecision, ...]:
    names = {b.name for b in sampled}
    decisions = []
    for block in blocks_all:
        on = block.name in names
        reason = (f"backward on {ratio:.0%} of the samples, weight gradients on {token_ratio:.0%} of their tokens"
                  if on else block.blocker or "a layer of it may not be approximated")
        decisions.append(RowBlockDecision(
            name=block.name, layers=list(block.layers), exact_flops=block.exact_flops,
            planned_flops=int(block.flops(ratio, token_ratio)) if on else block.exact_flops,
            ratio=ratio if on else 1.0, sampled=on, reason=reason))
    return tuple(decisions)


def row_plan(gm: torch.fx.GraphModule, ratio: float, token_ratio: float, tau: float | None, note: str,
             options: dict | None = None) -> RowPlan:
    """The :class:`~fxapprox.row_plan.RowPlan` of ``gm``'s eligible blocks at ``ratio`` and ``token_ratio``
    (``options``: a numeric budget's token ratio → keep-ratio pairs)."""
    sampled = eligible_row_blocks(gm)
    return RowPlan(blocks=_block_decisions(row_blocks_of(gm), sampled, ratio, token_ratio),
                   token_ratio=token_ratio, tau=tau, note=note,
                   options=tuple((t, r) for t, r in (options or {}).items()))


def with_ratios(plan, gm: torch.fx.GraphModule, ratio: float, token_ratio: float, measured=None, step=None):
    """``plan`` (a :class:`fxapprox.plan.Plan` with ``rows``) at new ratios: its blocks, its linear layers' decisions
    and its totals; ``measured`` (a variance check) and ``step`` recorded."""
    rows = plan.rows
    sampled_names = {b.name for b in rows.sampled}
    blocks = [b for b in row_blocks_of(gm) if b.name in sampled_names]
    by_node = {n.name: n for n in gm.graph.nodes}
    layers = []
    for decision in plan.layers:
        if decision.approximate and decision.mode == ROWS:
            candidate = _row_candidate(by_node[decision.node], ratio, token_ratio)
            decision = dataclasses.replace(decision, planned_flops=candidate.flops, k=candidate.k)
        layers.append(decision)
    new_rows = dataclasses.replace(rows, blocks=_block_decisions(row_blocks_of(gm), blocks, ratio, token_ratio),
                                   token_ratio=token_ratio)
    if measured is not None:
        new_rows = dataclasses.replace(new_rows, sgd_variance=measured.sgd_variance, row_variance=measured.row_variance,
                                       token_variance=measured.token_variance, noise_scale=measured.noise_scale,
                                       checked_step=step, checked_ratio=measured.ratio,
                                       checked_token_ratio=measured.token_ratio)
    planned = plan.total_exact_flops - new_rows.saved_flops - sum(
        d.exact_flops - d.planned_flops for d in layers if d.approximate and d.mode != ROWS)
    return dataclasses.replace(plan, layers=tuple(layers), rows=new_rows, total_planned_flops=int(planned))


