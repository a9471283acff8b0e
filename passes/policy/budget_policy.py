"""Pass 4c — budget policy: turn ``budget`` into an explicit, serialisable plan.

``budget`` is the fraction of the exact model's training-step FLOPs (forward + backward, as measured by the flops
pass) the approximated model executes: a number is an instruction, spent whenever the model's candidate layers
reach it, and ``"auto"`` asks the pay-off model to choose. The policy reads what the candidates pass (and, for
the measured policy, the measurement pass) wrote (each layer's :class:`~fxapprox.pipeline.records.LayerCandidates`) and
runs in four phases, one function each:

1. :func:`_layers_and_totals` — the nodes the plan lists and the FLOP target;
2. a policy (``config.policy``) chooses, for each layer, one candidate or none, with the reason:

   * ``"measured"`` (:func:`~fxapprox.passes.policy.measured_policy.measured_choices`): the least predicted cost for the
     budget from the measured candidates (errors and speed), or for ``"auto"`` the plan predicted to reach a
     given loss soonest;
   * ``"flops"`` (:func:`~fxapprox.passes.policy.fixed_ratio_policy.flops_choices`): the FLOP-ranked walk at the
     preferred ``keep_ratio``, then one common ratio lowered to ``min_keep_ratio``;
   * ``"uniform"`` (:func:`~fxapprox.passes.policy.fixed_ratio_policy.uniform_choices`): every eligible layer at
     ``keep_ratio``;

3. :func:`decisions_for` — one :class:`~fxapprox.plan.LayerDecision` per layer;
4. :mod:`~fxapprox.passes.policy.plan_note` — the note and the warnings: the totals, what the pay-off model predicts and
   advises, and, when the budget is out of reach, which layers cannot be sampled and why.
"""

from __future__ import annotations

import math

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.op_kinds.registry import handler_for
from fxapprox.passes.analysis.graph_view import target_name
from fxapprox.passes.measurement.candidates import enumerate_candidates, planned_layers
from fxapprox.passes.measurement.error_model import one_draw_errors
from fxapprox.passes.policy.fixed_ratio_policy import flops_choices, uniform_choices
from fxapprox.passes.policy.measured_policy import AUTO_BUDGET, describe_candidate, measured_choices
from fxapprox.passes.policy.plan_note import plan_note
from fxapprox.passes.policy.policy_types import PolicySummary
from fxapprox.pipeline.records import (DECISION_KEY, Candidate, PlannedLayer, candidates_of, kind_of, rank_of,
                                       saved_of, tensor_of, train_flops)
from fxapprox.plan import LayerDecision, Plan

__all__ = ["AUTO_BUDGET", "assemble_plan", "decisions_for", "describe_candidate", "plan_budget"]


# -- phase 1 -------------------------------------------------------------------------------------------------
def _layers_and_totals(gm: torch.fx.GraphModule, budget: float) -> tuple[list[torch.fx.Node], int, float]:
    layers = planned_layers(gm)
    total = sum(train_flops(n) for n in gm.graph.nodes)
    return layers, total, budget * total


# -- phase 2 -------------------------------------------------------------------------------------------------
_POLICIES = {"measured": measured_choices, "flops": flops_choices, "uniform": uniform_choices}


# -- phase 3 -------------------------------------------------------------------------------------------------
def _public_candidate(candidate: Candidate) -> dict:
    return {key: getattr(candidate, key) for key in ("method", "mode", "keep_ratio", "k", "n", "flops", "blocked",
                                                     "errors", "bias", "noise", "speedup", "seconds",
                                                     "predicted_error")}


def decisions_for(gm, layers, choices: dict, config: ApproxConfig, measured: bool) -> list[LayerDecision]:
    decisions = []
    for node in layers:
        kind = kind_of(node)
        choice = choices[node]
        candidate = choice.candidate
        exact = train_flops(node)
        approximate = candidate is not None
        method = candidate.method if approximate else None
        rank = rank_of(node)
        layer = candidates_of(node)
        decision = LayerDecision(
            node=node.name, target=target_name(node), op_kind=kind.op_kind, shape=tensor_of(node).shape,
            in_channels=kind.in_channels, out_channels=kind.out_channels, exact_flops=exact,
            planned_flops=int(candidate.flops) if approximate else exact, approximate=approximate,
            reason=choice.reason, method=method, mode=candidate.mode if approximate else None,
            k=candidate.k if approximate else None, n=candidate.n if approximate else None,
            random_share=config.random_share if approximate and method == "topk" and handler_for(node).uses_random_share
            else 0.0,
            rank=None if rank is None else rank.rank, saved_bytes=saved_of(node).bytes,
            predicted_error=(choice.predicted_error if approximate else 0.0) if measured else None,
            measured_speedup=candidate.speedup if approximate else None,
            measured_errors=candidate.errors if approximate else None,
            isolated_grad_error=one_draw_errors(candidate).get("weight_grad") if approximate and measured else None,
            candidates=[_public_candidate(c) for c in (layer.candidates if layer is not None else ())]
            if measured else [])
        # the candidate itself (a re-plan starts from it; it may be interpolated)
        node.meta[DECISION_KEY] = PlannedLayer(decision, candidate)
        decisions.append(decision)
    return decisions


def plan_budget(gm: torch.fx.GraphModule, budget: float | str, method: str,
                config: ApproxConfig | None = None, *, calibration=None) -> Plan:
    """Make the plan for ``gm`` (analysed, ranked; measured for the measured policy) under ``budget``.

    Writes each layer's decision (a :class:`~fxapprox.pipeline.records.PlannedLayer`) under ``node.meta[DECISION_KEY]``
    and returns the :class:`Plan`.
    Runs ``enumerate_candidates`` first when it has not run yet. ``calibration`` (measured policy): the measured ÷
    predicted error factors per family the candidates' predictions are scaled by (``passes/guard/check_plan.py``).

    Example::

        >>> plan = plan_budget(gm, 0.5, "topk", ApproxConfig(policy="flops"))
        >>> plan.budget_met, round(plan.achieved, 2)
        (True, 0.5)
    """
    config = config or ApproxConfig()
    auto = budget == AUTO_BUDGET
    if auto and (config.policy != "measured" or config.min_gain is None):
        raise ValueError('budget="auto" chooses the budget from measured errors and speed: it needs '
                         'ApproxConfig(policy="measured") and a min_gain (not None); pass a numeric budget '
                         '(e.g. approximate(model, 0.5)) to choose the FLOPs yourself')
    fraction = 0.0 if auto else budget
    layers, total, target = _layers_and_totals(gm, fraction)
    if any(candidates_of(n) is None for n in layers):
        enumerate_candidates(gm, method, config)
    summary = PolicySummary(method=method, calibration=calibration)
    choices = _POLICIES[config.policy](gm, layers, budget, total, target, config, summary)
    measured = config.policy == "measured"
    decisions = decisions_for(gm, layers, choices, config, measured)
    planned_total = total - sum(d.exact_flops - d.planned_flops for d in decisions)
    budget_met = auto or planned_total <= target + 0.5 or budget >= 1.0
    note, warnings = plan_note(budget, total, planned_total, budget_met, decisions, config, summary)
    return assemble_plan(budget, method, total, decisions, config, note, summary if measured else None,
                         budget_met, warnings)


def assemble_plan(budget, method: str, total: float, decisions: list, config: ApproxConfig, note: str,
                  summary: PolicySummary | None, budget_met: bool, warnings=()) -> Plan:
    """The :class:`Plan` of ``decisions``; ``summary`` carries the measured policy's predictions (``None`` for the
    other policies)."""
    planned_total = total - sum(d.exact_flops - d.planned_flops for d in decisions)
    measured = summary is not None
    return Plan(budget=budget, method=method, total_exact_flops=int(total),
                total_planned_flops=int(planned_total), budget_met=budget_met, note=note,
                layers=tuple(decisions), config=config.to_dict(),
                predicted_error=math.sqrt(summary.squared_error) if measured else None,
                predicted_step_error=math.sqrt(summary.step_squared_error) if measured else None,
                predicted_speedup=summary.predicted_speedup if measured else None,
                predicted_gain=summary.predicted_gain if measured else None,
                predicted_steps=summary.predicted_steps if measured else None,
                auto_advice=summary.auto_advice if measured else None,
                warnings=tuple(warnings),
                lowest_reachable=summary.lowest_reachable if measured else None)
