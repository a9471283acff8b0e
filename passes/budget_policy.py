"""Pass 4c — budget policy: turn ``budget`` into an explicit, serialisable plan.

``budget`` is the fraction of the exact model's training-step FLOPs (forward +
backward, as measured by the flops pass) the approximated model may spend.
The policy reads what the candidates pass (and, for the measured policy, the
measurement pass) wrote (each layer's :class:`~fxapprox.records.LayerCandidates`) and runs in four phases,
one function each:

1. :func:`_layers_and_totals` — the nodes the plan lists and the FLOP target;
2. a policy (``config.policy``) chooses, for each layer, one candidate or none,
   with the reason:

   * ``"measured"`` (:func:`_measured_choices`): a layer's options are "exact"
     and its candidates that were measured at least ``min_speedup`` faster than
     the exact op. Each option's predicted error is what it adds to the model's
     gradient error (:func:`predicted_contribution`). Options are reduced to
     each layer's lower convex hull of (FLOPs saved, error), and the hull steps
     of all layers are taken in order of least error per FLOP saved until the
     budget is met (the greedy solution of the multiple-choice knapsack),
     skipping steps that would take the predicted model-gradient error past
     ``max_grad_error``;
   * ``"flops"`` (:func:`~fxapprox.passes.fixed_ratio_policy.flops_choices`): the FLOP-ranked walk at the preferred
     ``keep_ratio``, then one common ratio lowered to ``min_keep_ratio``;
   * ``"uniform"`` (:func:`~fxapprox.passes.fixed_ratio_policy.uniform_choices`): every eligible layer at
     ``keep_ratio``;

3. :func:`decisions_for` — one :class:`~fxapprox.plan.LayerDecision` per layer;
4. :func:`_note` — the totals and, when the budget is not met, why.

The predicted error of a candidate is :mod:`fxapprox.passes.error_model`'s; the FLOP-ranked and uniform
policies are in :mod:`fxapprox.passes.fixed_ratio_policy`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.op_kinds import handler_for
from fxapprox.plan import LayerDecision, Plan
from fxapprox.passes._allocation import least_error_allocation
from fxapprox.records import (CANDIDATES_KEY, DECISION_KEY, Candidate, PlannedLayer, candidates_of, kind_of,
                              rank_of, saved_of, tensor_of, train_flops)
from fxapprox.passes.candidates import enumerate_candidates, planned_layers
from fxapprox.passes.graph_view import target_name
from fxapprox.passes.error_model import one_draw_errors, output_layers, predicted_contribution, propagation_weights
from fxapprox.passes.fixed_ratio_policy import flops_choices, uniform_choices
from fxapprox.passes.interpolation import raise_last_ratio
from fxapprox.passes.payoff import add_times, gain_model, predicted_cost, step_cost, time_saved
from fxapprox.passes.policy_types import TOLERANCE as _TOLERANCE, Choice

#: ``approximate(model, budget="auto")``: the policy chooses the FLOPs (the plan with the highest predicted gain)
AUTO_BUDGET = "auto"


# -- phase 1 -------------------------------------------------------------------------------------------------
def _layers_and_totals(gm: torch.fx.GraphModule, budget: float) -> tuple[list[torch.fx.Node], int, float]:
    layers = planned_layers(gm)
    total = sum(train_flops(n) for n in gm.graph.nodes)
    return layers, total, budget * total


def _saving(node: torch.fx.Node, candidate: Candidate) -> int:
    return train_flops(node) - candidate.flops


# -- phase 2: measured ---------------------------------------------------------------------------------------
def _describe(candidate: Candidate) -> str:
    speed = "" if candidate.speedup is None else f", {candidate.speedup:.2f}x faster"
    return (f"{candidate.mode} {candidate.method} at keep {candidate.keep_ratio:.2f} "
            f"(predicted error {candidate.predicted_error:.3f}{speed})")


def _predicted(candidate: Candidate, node: torch.fx.Node, weights: dict, owners: int, heads: set,
               config: ApproxConfig) -> Candidate:
    """``candidate`` with its predicted contribution to the model-gradient error and its step cost."""
    contribution = predicted_contribution(candidate.errors, weights.get(node.name, 0.0), owners, candidate.mode,
                                          candidate.bias, candidate.noise, head=node.name in heads)
    # The same with the noise of one draw counted whole: what one step's gradient shows (the guard).
    step_contribution = predicted_contribution(one_draw_errors(candidate), weights.get(node.name, 0.0), owners,
                                               candidate.mode, candidate.bias, candidate.noise,
                                               head=node.name in heads)
    predicted = dataclasses.replace(candidate, contribution=contribution, predicted_error=math.sqrt(contribution),
                                    step_contribution=step_contribution)
    return dataclasses.replace(predicted, step_cost=step_cost(predicted, config.backward_error_cost,
                                                              config.forward_error_cost))


def _write_candidates(node: torch.fx.Node, updated: dict[int, Candidate]) -> None:
    """Record the policy's versions of ``node``'s candidates (a re-plan starts from them)."""
    layer = candidates_of(node)
    node.meta[CANDIDATES_KEY] = dataclasses.replace(
        layer, candidates=tuple(updated.get(id(c), c) for c in layer.candidates))


def _measured_choices(gm, layers, budget, total, target, config: ApproxConfig, summary: dict) -> dict:
    weights, owners = propagation_weights(gm)
    heads = output_layers(gm)
    choices: dict = {}
    usable: dict = {}
    pinned: dict = {}
    for node in layers:
        layer = candidates_of(node)
        if layer.blocker:
            choices[node] = Choice(None, layer.blocker)
            continue
        predicted = {id(c): _predicted(c, node, weights, owners, heads, config) for c in layer.candidates
                     if c.blocked is None and c.measured}
        _write_candidates(node, predicted)
        measured = list(predicted.values())
        fast = [c for c in measured if config.min_speedup is None or
                (c.speedup is not None and c.speedup >= config.min_speedup)]
        if layer.pinned_ratio is not None:
            if measured:
                best = min(fast or measured, key=lambda c: c.contribution)
                pinned[node] = best
                choices[node] = Choice(best, f"keep-ratio pinned by override {layer.pinned_by}: {_describe(best)}",
                                        best.predicted_error)
            else:
                choices[node] = Choice(None, f"keep-ratio {layer.pinned_ratio:g} pinned by override "
                                              f"{layer.pinned_by}, but "
                                        + _why_no_candidate(layer, measured, config))
            continue
        if not fast:
            choices[node] = Choice(None, _why_no_candidate(layer, measured, config))
            continue
        usable[node] = fast
    fixed_saving = sum(_saving(n, c) for n, c in pinned.items())
    fixed_error = sum(c.contribution for c in pinned.values())
    fixed_step_error = sum(c.step_contribution for c in pinned.values())
    fixed_cost = sum(c.step_cost for c in pinned.values())
    needed = max(0.0, total - target - fixed_saving)
    free = [n for n in layers if n in usable]
    cap = None
    if config.max_grad_error is not None:
        cap = math.sqrt(max(config.max_grad_error ** 2 - fixed_error, 0.0))
    if budget >= 1.0:
        for node in free:
            choices[node] = Choice(None, "budget 1.0: exact training requested")
        summary.update(squared_error=fixed_error, step_squared_error=fixed_step_error, uncapped_error=None,
                       capped=False)
        return choices
    for node in free:
        exact_seconds = candidates_of(node).exact_seconds
        with_savings = {id(c): dataclasses.replace(c, saving=_saving(node, c), time_saving=None
                                                   if exact_seconds is None or c.seconds is None
                                                   else exact_seconds - c.seconds)
                        for c in usable[node]}
        usable[node] = list(with_savings.values())
        _write_candidates(node, with_savings)
    fixed_time = time_saved(pinned)
    payoff = gain_model(gm, total, config)
    objective = None
    peak: dict = {}
    if payoff is not None:
        def objective(chosen, saved, squared):
            seconds, flops_saved, cost = add_times(fixed_time, time_saved(chosen)), fixed_saving + saved, \
                fixed_cost + predicted_cost(chosen)
            value = payoff.gain(seconds, flops_saved, cost)
            if chosen and value > peak.get("gain", -math.inf):   # the best sampled plan, for the note
                peak.update(gain=value, text=f"{(total - flops_saved) / total:.2f} of the FLOPs, "
                                             + payoff.describe(seconds, flops_saved, cost))
            return value
    # With the pay-off model and timed candidates, walk towards the most time saved per extra step.
    timed = objective is not None and all(c.time_saving is not None for n in free for c in usable[n])
    rate = ("time_saving", "step_cost") if timed else ("saving", "contribution")
    chosen, saved, squared, capped = least_error_allocation(free, usable, needed, cap, objective, rate)
    if chosen and saved > needed + _TOLERANCE:
        squared += raise_last_ratio(chosen, usable, saved - needed)
    # The same allocation without the tolerance: what meeting the budget would cost (for the note).
    uncapped, uncapped_saved, uncapped_squared, _ = least_error_allocation(free, usable, needed, None)
    if uncapped and uncapped_saved > needed + _TOLERANCE:
        uncapped_squared += raise_last_ratio(uncapped, usable, uncapped_saved - needed)
    stopped_for_gain = False
    if payoff is not None and saved < needed - _TOLERANCE:
        # Stopped by the gain when the walk without it (same cap) saves more than the objective kept.
        walked = least_error_allocation(free, usable, needed, cap, None, rate)[1]
        stopped_for_gain = saved < walked - _TOLERANCE or not capped
    if payoff is not None and chosen:
        gain = payoff.gain(add_times(fixed_time, time_saved(chosen)), fixed_saving + saved,
                           fixed_cost + predicted_cost(chosen))
        if gain < config.min_gain:
            summary["unpaid"] = f"{(total - fixed_saving - saved) / total:.2f} of the FLOPs, " + payoff.describe(
                add_times(fixed_time, time_saved(chosen)), fixed_saving + saved, fixed_cost + predicted_cost(chosen))
            chosen, saved, squared, stopped_for_gain = {}, 0.0, 0.0, True
    if payoff is not None and not chosen and "unpaid" not in summary and peak:
        summary["unpaid"] = peak["text"]
    if payoff is not None:
        summary.update(payoff=payoff, predicted_speedup=payoff.speedup(add_times(fixed_time, time_saved(chosen)),
                                                                       fixed_saving + saved),
                       predicted_steps=payoff.steps(fixed_cost + predicted_cost(chosen)))
        summary["predicted_gain"] = summary["predicted_speedup"] / summary["predicted_steps"]
    summary.update(squared_error=fixed_error + squared, capped=bool(capped), stopped_for_gain=stopped_for_gain,
                   step_squared_error=fixed_step_error + sum(c.step_contribution for c in chosen.values()),
                   uncapped_error=math.sqrt(fixed_error + uncapped_squared),
                   uncapped_reachable=uncapped_saved >= needed - _TOLERANCE)
    for node in free:
        candidate = chosen.get(node)
        if candidate is not None:
            raised = ", keep-ratio raised so no more is cut than the budget needs" if candidate.interpolated else ""
            choices[node] = Choice(candidate, f"least error per FLOP saved: {_describe(candidate)}{raised}",
                                    candidate.predicted_error)
        elif stopped_for_gain:
            choices[node] = Choice(None, "not sampled: more sampling is predicted to cost more training steps than "
                                          "it saves time (" + (summary.get("unpaid") or "gain past its peak") + ")")
        elif node in capped:
            best = min(usable[node], key=lambda c: c.contribution)
            choices[node] = Choice(None, f"max_grad_error={config.max_grad_error:g} reached: its best candidate "
                                          f"would add error {best.predicted_error:.3f}")
        else:
            choices[node] = Choice(None, "not needed: layers with less error per FLOP saved meet the budget")
    return choices


def _why_no_candidate(layer, measured: list, config: ApproxConfig) -> str:
    candidates = layer.candidates
    if not candidates:
        return "no candidate on the keep-ratio grid keeps fewer pairs than it has"
    if not measured:
        blocked = Counter(c.blocked for c in candidates if c.blocked)
        return "no candidate fits: " + "; ".join(reason for reason, _ in blocked.most_common(2))
    speeds = [c.speedup for c in measured if c.speedup is not None]
    best = max(speeds) if speeds else 0.0
    return f"no candidate measured faster than exact (best {best:.2f}x < min_speedup={config.min_speedup:g})"


# -- phase 2: FLOP-ranked walk and uniform recipe -----------------------------------------------------------
_POLICIES = {"measured": _measured_choices, "flops": flops_choices, "uniform": uniform_choices}


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


def plan_budget(gm: torch.fx.GraphModule, budget: float, method: str,
                config: ApproxConfig | None = None) -> Plan:
    """Make the plan for ``gm`` (analysed, ranked; measured for the measured policy) under ``budget``.

    Writes each layer's decision (a :class:`~fxapprox.records.PlannedLayer`) under ``node.meta[DECISION_KEY]`` and
    returns the :class:`Plan`.
    Runs ``enumerate_candidates`` first when it has not run yet.

    Example::

        >>> plan = plan_budget(gm, 0.5, "topk", ApproxConfig(policy="flops"))
        >>> plan.budget_met, round(plan.achieved, 2)
        (True, 0.5)
    """
    config = config or ApproxConfig()
    auto = budget == AUTO_BUDGET
    if auto and (config.policy != "measured" or config.min_gain is None):
        raise ValueError('budget="auto" chooses the budget from measured errors and speed: it needs '
                         'ApproxConfig(policy="measured") and a min_gain (not None)')
    fraction = 0.0 if auto else budget
    layers, total, target = _layers_and_totals(gm, fraction)
    if any(candidates_of(n) is None for n in layers):
        enumerate_candidates(gm, method, config)
    summary: dict = {"method": method}
    choices = _POLICIES[config.policy](gm, layers, fraction, total, target, config, summary)
    measured = config.policy == "measured"
    decisions = decisions_for(gm, layers, choices, config, measured)
    planned_total = total - sum(d.exact_flops - d.planned_flops for d in decisions)
    budget_met = auto or planned_total <= target + 0.5 or budget >= 1.0
    predicted = math.sqrt(summary.get("squared_error", 0.0)) if measured else None
    note = _note(budget, total, planned_total, budget_met, decisions, config, summary, predicted)
    return assemble_plan(budget, method, total, decisions, config, note, summary if measured else None,
                         budget_met)


def assemble_plan(budget, method: str, total: float, decisions: list, config: ApproxConfig, note: str,
                  summary: dict | None, budget_met: bool) -> Plan:
    """The :class:`Plan` of ``decisions``; ``summary`` carries the measured policy's predictions (``None`` for the
    other policies)."""
    planned_total = total - sum(d.exact_flops - d.planned_flops for d in decisions)
    summary = summary or {}
    measured = bool(summary)
    return Plan(budget=budget, method=method, total_exact_flops=int(total),
                total_planned_flops=int(planned_total), budget_met=budget_met, note=note,
                layers=tuple(decisions), config=config.to_dict(),
                predicted_error=math.sqrt(summary.get("squared_error", 0.0)) if measured else None,
                predicted_step_error=math.sqrt(summary.get("step_squared_error", 0.0)) if measured else None,
                predicted_speedup=summary.get("predicted_speedup"), predicted_gain=summary.get("predicted_gain"))


# -- phase 4 -------------------------------------------------------------------------------------------------
def _note(budget, total, planned, met, decisions, config, summary, predicted) -> str:
    achieved = planned / total if total else 1.0
    if total == 0:
        return "the model does no measured FLOPs: nothing to approximate"
    if budget != AUTO_BUDGET and budget >= 1.0:
        return "budget 1.0: the plan is exact"
    sampled = sum(d.approximate for d in decisions)
    payoff = summary.get("payoff")
    if payoff is not None and summary.get("stopped_for_gain"):
        gain = (f"predicted {summary['predicted_speedup']:.2f}x faster per step, {summary['predicted_steps']:.2f}x "
                f"the steps: {summary['predicted_gain']:.2f}x sooner to the same loss")
        asked = "budget auto" if budget == AUTO_BUDGET else f"budget {budget:g} not spent"
        if not sampled:
            unpaid = summary.get("unpaid")
            best = f" (the best plan: {unpaid})" if unpaid else ""
            return (f"{asked}: no sampled plan is predicted to reach a given loss sooner than exact training"
                    f"{best}; the model trains exactly. min_gain=None spends the budget regardless")
        return (f"{asked}: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs, "
                f"predicted model-gradient error {predicted:.3f}; {gain}. Sampling more is predicted to cost more "
                f"training steps than it saves time")
    if budget == AUTO_BUDGET:
        return (f"budget auto: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs"
                + ("" if predicted is None else f", predicted model-gradient error {predicted:.3f}"))
    if config.policy == "uniform":
        return (f"uniform recipe (keep-ratio {config.keep_ratio:g} for layers with >= {config.min_channels} "
                f"channels): {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs; "
                f"budget {budget:g} {'met' if met else 'not met'}")
    error = "" if predicted is None else f", predicted model-gradient error {predicted:.3f}"
    if payoff is not None and sampled:
        error += (f"; predicted {summary['predicted_speedup']:.2f}x faster per step, {summary['predicted_steps']:.2f}x "
                  f"the steps: {summary['predicted_gain']:.2f}x sooner to the same loss")
    if met:
        return (f"budget {budget:g} met: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training "
                f"FLOPs{error}")
    if config.policy == "measured" and summary.get("capped"):
        at_budget = (f"meeting budget {budget:g} would take it to {summary['uncapped_error']:.3f}"
                     if summary.get("uncapped_reachable") else
                     f"even without the tolerance the measured candidates reach only part of budget {budget:g}")
        return (f"budget {budget:g} not reachable within max_grad_error={config.max_grad_error:g}: the least-error "
                f"plan within it spends {achieved:.3f} of exact training FLOPs{error}; {at_budget}. "
                f"{achieved:.3f} is the lowest budget this model reaches within the tolerance")
    exact_share = sum(d.exact_flops for d in decisions if not d.approximate) / total
    blockers = Counter(d.reason.split(":")[0] for d in decisions if not d.approximate)
    top = "; ".join(f"{reason} ({count})" for reason, count in blockers.most_common(3))
    tail = ("every layer's candidates are used at their lowest keep-ratio" if config.policy == "measured"
            else f"sampled layers stop at min_keep_ratio={config.min_keep_ratio:g}")
    return (f"budget {budget:g} not reachable: achieved {achieved:.3f}{error}. {exact_share:.0%} of training FLOPs "
            f"are in layers that stay exact ({top or 'none'}), and {tail}")
