"""Pass 4c, the measured policy: which measured candidate each layer takes, for a budget or for ``"auto"``.

A layer's options are "exact" and its measured candidates. Each candidate's predicted error is what it adds to
the model's gradient error (:func:`~fxapprox.passes.measurement.error_model.predicted_contribution`), its step cost
the extra training steps the pay-off model predicts for it (:mod:`fxapprox.passes.policy.payoff`). Options are
reduced to each layer's lower convex hull and the hull steps of all layers are taken cheapest first (the greedy
solution of the multiple-choice knapsack, :func:`~fxapprox.passes.policy._allocation.least_error_allocation`).

**A numeric budget is an instruction**: the plan executes at most that fraction of exact training FLOPs whenever
the layers' candidates reach it. The walk orders the hull steps by their predicted change of the time to a given
loss per FLOP saved: a candidate's *net cost* is its predicted extra steps less the share of the exact step's time
it saves (measured; the FLOP share where nothing was timed), so a candidate that pays comes first and one measured
slower than the exact op pays for its slowdown. It goes as far as the budget needs, in three widening rounds, each
a fresh allocation over more options, and stops at the first that meets it:

1. candidates measured at least ``min_speedup`` faster than the exact op, within ``max_grad_error``;
2. the same candidates past ``max_grad_error`` (the plan warns: the prediction says the budget may cost accuracy);
3. every measured candidate, those measured slower than ``min_speedup`` too (the plan warns: the FLOPs fall, the
   step time need not).

The last layer taken has its keep-ratio raised off the grid so no more is cut than the budget needs
(:mod:`fxapprox.passes.policy.interpolation`). What ``budget="auto"`` would do is worked out beside it and said in the
note: the pay-off model advises, the number decides.

**``budget="auto"``** is the pay-off model's choice: the walk over round 1's options, by predicted extra steps per
second saved (by error per FLOP where something was not timed), stops where the predicted gain (step speed-up ÷
predicted steps) is highest, and the model stays exact when that gain is below ``min_gain``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from fxapprox.config import ApproxConfig
from fxapprox.passes.measurement.error_model import (one_draw_errors, output_layers, predicted_contribution,
                                                     propagation_weights)
from fxapprox.passes.measurement.measure_candidates import EXACT_STEP_KEY
from fxapprox.passes.policy._allocation import least_error_allocation
from fxapprox.passes.policy.interpolation import trim_overshoot
from fxapprox.passes.policy.payoff import GainModel, add_times, predicted_cost, step_cost, time_saved
from fxapprox.passes.policy.policy_types import TOLERANCE, Choice, PolicySummary
from fxapprox.pipeline.records import CANDIDATES_KEY, Candidate, candidates_of, train_flops

__all__ = ["AUTO_BUDGET", "describe_candidate", "measured_choices"]

#: ``approximate(model, budget="auto")``: the policy chooses the FLOPs (the plan with the highest predicted gain)
AUTO_BUDGET = "auto"
_FLOP_RATE = ("saving", "contribution")
_TIME_RATE = ("time_saving", "step_cost")
_NET_RATE = ("saving", "net_cost")
_RATE_WORDS = {_FLOP_RATE: "least error per FLOP saved", _TIME_RATE: "least predicted extra steps per second saved",
               _NET_RATE: "least predicted time to a given loss per FLOP saved"}


def describe_candidate(candidate: Candidate) -> str:
    speed = "" if candidate.speedup is None else f", {candidate.speedup:.2f}x faster"
    return (f"{candidate.mode} {candidate.method} at keep {candidate.keep_ratio:.2f} "
            f"(predicted error {candidate.predicted_error:.3f}{speed})")


def _predicted(candidate: Candidate, node, weights: dict, owners: int, heads: set, config: ApproxConfig,
               factors=None) -> Candidate:
    """``candidate`` with its predicted contribution to the model-gradient error and its step cost; with ``factors``
    (the plan's check, ``passes/guard/check_plan.py``) scaled by its family's measured ÷ predicted factor, the unscaled
    predictions kept in the ``raw_`` fields (what the guard's own calibration compares with)."""
    contribution = predicted_contribution(candidate.errors, weights.get(node.name, 0.0), owners, candidate.mode,
                                          candidate.bias, candidate.noise, head=node.name in heads)
    # The same with the noise of one draw counted whole: what one step's gradient shows (the guard).
    step_contribution = predicted_contribution(one_draw_errors(candidate), weights.get(node.name, 0.0), owners,
                                               candidate.mode, candidate.bias, candidate.noise,
                                               head=node.name in heads)
    predicted = dataclasses.replace(candidate, contribution=contribution, predicted_error=math.sqrt(contribution),
                                    step_contribution=step_contribution)
    predicted = dataclasses.replace(predicted, step_cost=step_cost(predicted, *config.error_costs))
    if factors is None:
        return predicted
    scale = factors.scale(predicted)
    return dataclasses.replace(
        predicted, raw_contribution=contribution, raw_step_contribution=step_contribution,
        raw_step_cost=predicted.step_cost, contribution=contribution * scale,
        predicted_error=math.sqrt(contribution * scale), step_contribution=step_contribution * scale,
        step_cost=predicted.step_cost * factors.scale(predicted, "step_cost"))


def _with_savings(node, candidate: Candidate, payoff: GainModel) -> Candidate:
    """``candidate`` with its FLOP and time savings and its net cost: predicted extra steps less the share of the
    exact step's time it saves (the FLOP share where nothing was timed), the first-order change of the time to a
    given loss."""
    exact_seconds = candidates_of(node).exact_seconds
    saving = train_flops(node) - candidate.flops
    time_saving = None if exact_seconds is None or candidate.seconds is None else exact_seconds - candidate.seconds
    if time_saving is not None and payoff.exact_step_seconds:
        share = time_saving / payoff.exact_step_seconds
    else:
        share = saving / payoff.total_flops if payoff.total_flops else 0.0
    return dataclasses.replace(candidate, saving=saving, time_saving=time_saving,
                               net_cost=(candidate.step_cost or 0.0) - share)


def _write_candidates(node, updated: dict[int, Candidate]) -> None:
    """Record the policy's versions of ``node``'s candidates (a re-plan starts from them)."""
    layer = candidates_of(node)
    node.meta[CANDIDATES_KEY] = dataclasses.replace(
        layer, candidates=tuple(updated.get(id(c), c) for c in layer.candidates))


def _fast(candidate: Candidate, config: ApproxConfig) -> bool:
    return config.min_speedup is None or (candidate.speedup is not None and candidate.speedup >= config.min_speedup)


def why_no_candidate(layer, measured: list, config: ApproxConfig) -> str:
    if not layer.candidates:
        return "no candidate on the keep-ratio grid keeps fewer pairs than it has"
    if not measured:
        blocked = Counter(c.blocked for c in layer.candidates if c.blocked)
        return "no candidate fits: " + "; ".join(reason for reason, _ in blocked.most_common(2))
    speeds = [c.speedup for c in measured if c.speedup is not None]
    best = max(speeds) if speeds else 0.0
    return f"no candidate measured faster than exact (best {best:.2f}x < min_speedup={config.min_speedup:g})"


@dataclasses.dataclass
class _Layers:
    """The measured policy's working record: each layer's options, the pinned choices and their totals."""

    options: dict          # node -> every measured candidate, with its predictions and savings
    fast: dict             # node -> the candidates at least min_speedup faster
    pinned: dict           # node -> the candidate an override pinned

    @property
    def free(self) -> list:
        return [n for n in self.options if n not in self.pinned]

    def fixed(self, key: str) -> float:
        return sum(getattr(c, key) or 0.0 for c in self.pinned.values())


def _collect(gm, layers, config: ApproxConfig, choices: dict, payoff: GainModel, factors=None) -> _Layers:
    weights, owners = propagation_weights(gm)
    heads = output_layers(gm)
    work = _Layers({}, {}, {})
    for node in layers:
        layer = candidates_of(node)
        if layer.blocker:
            choices[node] = Choice(None, layer.blocker)
            continue
        predicted = {id(c): _with_savings(node, _predicted(c, node, weights, owners, heads, config, factors), payoff)
                     for c in layer.candidates if c.blocked is None and c.measured}
        _write_candidates(node, predicted)
        measured = list(predicted.values())
        if node.name in heads and layer.pinned_ratio is None and config.mode is None:
            # An output layer's forward error is the loss's own: the layers below cannot adapt to it, and the
            # error costs fitted on inner layers understate it (benchmarks/output_layer.py: the LM head sampled
            # in its forward cost a fine-tuned model 60% validation loss). It takes one of its other modes where
            # one was measured; a mode the user pins (config or override) is taken as asked.
            measured = [c for c in measured if c.mode != "forward"] or measured
        fast = [c for c in measured if _fast(c, config)]
        if layer.pinned_ratio is not None:
            if measured:
                best = min(fast or measured, key=lambda c: c.contribution)
                work.pinned[node] = best
                choices[node] = Choice(best, f"keep-ratio pinned by override {layer.pinned_by}: "
                                              f"{describe_candidate(best)}", best.predicted_error)
            else:
                choices[node] = Choice(None, f"keep-ratio {layer.pinned_ratio:g} pinned by override "
                                              f"{layer.pinned_by}, but " + why_no_candidate(layer, measured, config))
            continue
        if not measured:
            choices[node] = Choice(None, why_no_candidate(layer, measured, config))
            continue
        work.options[node] = measured
        work.fast[node] = fast
    return work


def _rate(options: dict) -> tuple[str, str]:
    """Walk by predicted extra steps per second saved where every option was timed, else by error per FLOP."""
    timed = options and all(c.time_saving is not None for group in options.values() for c in group)
    return _TIME_RATE if timed else _FLOP_RATE


def _gain(payoff: GainModel, work: _Layers, chosen: dict, saved: float) -> float:
    return payoff.gain(add_times(work.fixed("time_saving"), time_saved(chosen)), work.fixed("saving") + saved,
                       work.fixed("step_cost") + predicted_cost(chosen))


def _describe_plan(payoff: GainModel, work: _Layers, chosen: dict, saved: float, total: float) -> str:
    seconds = add_times(work.fixed("time_saving"), time_saved(chosen))
    flops_saved = work.fixed("saving") + saved
    return (f"{(total - flops_saved) / total:.2f} of the FLOPs, "
            + payoff.describe(seconds, flops_saved, work.fixed("step_cost") + predicted_cost(chosen)))


def _auto_allocation(work: _Layers, payoff: GainModel, total: float, config: ApproxConfig, cap,
                     summary: PolicySummary):
    """``(chosen, saved, squared, capped, stopped_for_gain, best sampled plan's description)``: the walk over the
    fast candidates stopped where the predicted gain peaks; nothing when that peak is below ``min_gain``."""
    free = [n for n in work.free if work.fast[n]]
    fast = {n: work.fast[n] for n in free}
    rate = _rate(fast)
    needed = max(0.0, total - work.fixed("saving"))
    peak: dict = {}

    def objective(chosen, saved, squared):
        value = _gain(payoff, work, chosen, saved)
        if chosen and value > peak.get("gain", -math.inf):   # the best sampled plan, for the note
            peak.update(gain=value, text=_describe_plan(payoff, work, chosen, saved, total))
        return value
    chosen, saved, squared, capped = least_error_allocation(free, fast, needed, cap, objective, rate)
    summary.walked_by = rate
    walked = least_error_allocation(free, fast, needed, cap, None, rate)[1]
    stopped = saved < walked - TOLERANCE or not capped
    unpaid = None
    if chosen and _gain(payoff, work, chosen, saved) < config.min_gain:
        unpaid = _describe_plan(payoff, work, chosen, saved, total)
        chosen, saved, squared, stopped = {}, 0.0, 0.0, True
    if not chosen and unpaid is None and peak:
        unpaid = peak["text"]
    return chosen, saved, squared, capped, stopped, unpaid


def _spend(work: _Layers, needed: float, cap, summary: PolicySummary):
    """The three widening rounds of a numeric budget (module docstring); ``(chosen, saved, squared)``."""
    fast = {n: work.fast[n] for n in work.free if work.fast[n]}
    rounds = [(fast, cap)] + ([(fast, None)] if cap is not None else []) + [({n: work.options[n] for n in work.free},
                                                                              None)]
    for options, round_cap in rounds:
        chosen, saved, squared, _ = least_error_allocation(list(options), options, needed, round_cap, None,
                                                           _NET_RATE)
        if saved >= needed - TOLERANCE:
            break
    summary.walked_by = _NET_RATE
    summary.slow_layers = tuple(n.name for n, c in chosen.items() if all(
        (f.mode, f.method, f.k) != (c.mode, c.method, c.k) for f in work.fast[n]))
    if chosen and saved > needed + TOLERANCE:
        squared += trim_overshoot(chosen, options, saved - needed)
        saved = sum(c.saving for c in chosen.values())
    return chosen, saved, squared


def measured_choices(gm, layers, budget, total, target, config: ApproxConfig, summary: PolicySummary) -> dict:
    """``{node: Choice}`` for every planned layer; fills ``summary`` with the plan's predictions."""
    choices: dict = {}
    payoff = GainModel(gm.meta.get(EXACT_STEP_KEY), total)
    work = _collect(gm, layers, config, choices, payoff, summary.calibration)
    auto = budget == AUTO_BUDGET
    if not auto and budget >= 1.0:
        for node in work.free:
            choices[node] = Choice(None, "budget 1.0: exact training requested")
        summary.squared_error, summary.step_squared_error = work.fixed("contribution"), \
            work.fixed("step_contribution")
        return choices
    cap = None
    if config.max_grad_error is not None:
        cap = math.sqrt(max(config.max_grad_error ** 2 - work.fixed("contribution"), 0.0))
    summary.lowest_reachable = (total - work.fixed("saving")
                                - sum(max(c.saving for c in work.options[n]) for n in work.free)) / total
    capped: set = set()
    if auto:
        chosen, saved, squared, capped, summary.stopped_for_gain, summary.unpaid = \
            _auto_allocation(work, payoff, total, config, cap, summary)
        summary.capped = bool(capped)
    else:
        needed = max(0.0, total - target - work.fixed("saving"))
        chosen, saved, squared = _spend(work, needed, cap, summary)
        summary.over_tolerance = config.max_grad_error is not None and \
            math.sqrt(work.fixed("contribution") + squared) > config.max_grad_error + 1e-9
        if config.min_gain is not None:
            summary.auto_advice = _auto_advice(work, payoff, total, config, cap,
                                               dataclasses.replace(summary))
    summary.payoff = payoff
    summary.predicted_speedup = payoff.speedup(add_times(work.fixed("time_saving"), time_saved(chosen)),
                                               work.fixed("saving") + saved)
    summary.predicted_steps = payoff.steps(work.fixed("step_cost") + predicted_cost(chosen))
    summary.squared_error = work.fixed("contribution") + squared
    summary.step_squared_error = work.fixed("step_contribution") + sum(c.step_contribution for c in chosen.values())
    for node in work.free:
        candidate = chosen.get(node)
        if candidate is not None:
            raised = ", keep-ratio raised so no more is cut than the budget needs" if candidate.interpolated else ""
            why = ("measured slower than min_speedup, taken because the budget needs its FLOPs"
                   if node.name in summary.slow_layers else _RATE_WORDS[summary.walked_by])
            choices[node] = Choice(candidate, f"{why}: {describe_candidate(candidate)}{raised}",
                                    candidate.predicted_error)
        elif not work.fast[node] and (auto or not summary.slow_layers):
            choices[node] = Choice(None, why_no_candidate(candidates_of(node), work.options[node], config))
        elif auto and summary.stopped_for_gain:
            choices[node] = Choice(None, "not sampled: more sampling is predicted to cost more training steps than "
                                          "it saves time (" + (summary.unpaid or "gain past its peak") + ")")
        elif auto and node in capped:
            best = min(work.fast[node], key=lambda c: c.contribution)
            choices[node] = Choice(None, f"max_grad_error={config.max_grad_error:g} reached: its best candidate "
                                          f"would add error {best.predicted_error:.3f}")
        else:
            choices[node] = Choice(None, "not needed: layers with " + _RATE_WORDS[summary.walked_by].replace(
                "least", "less") + " meet the budget")
    return choices


def _auto_advice(work: _Layers, payoff: GainModel, total: float, config: ApproxConfig, cap,
                 scratch: PolicySummary) -> str:
    """What ``budget="auto"`` would plan on the same measurements, in one phrase."""
    chosen, saved, _, _, _, unpaid = _auto_allocation(work, payoff, total, config, cap, scratch)
    if not chosen and not work.pinned:
        best = f" (the best sampled plan: {unpaid})" if unpaid else ""
        return f'budget="auto" would train exactly{best}'
    return (f'budget="auto" would sample {len(chosen) + len(work.pinned)} layer(s): '
            + _describe_plan(payoff, work, chosen, saved, total))
