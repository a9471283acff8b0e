"""Re-plan from a check: the compute plan made again with measured errors in place of predicted ones.

The guard (``fxapprox/runtime/guard.py``) measures, on one training step, what the plan predicted:

* ``backward_error`` — the model-gradient error of the layers sampled in their backward (modes ``backward``,
  ``weight_grad``; the LSTM) and of compressed activations: the user's gradient against the gradient of the same
  forward with an exact backward. The plan predicts it as the root of the sum of those candidates' one-draw
  contributions (``step_contribution``);
* ``output_error`` — how far the model's output moves under forward sampling: ‖y − y_exact‖ / ‖y_exact‖. The plan
  predicts it from each forward-sampled layer's own output error in one draw (errors adding in squares); it
  calibrates the forward family's predicted extra steps (``fxapprox.passes.policy.payoff``);
* the forward family's gradient error — what the model-gradient error has beyond ``backward_error`` (errors
  adding in squares): forward sampling's error is mostly bias, so one step shows it whole. It calibrates the
  family's predicted effective contributions.

Their squared ratios against the predictions calibrate the families' predicted contributions
(``calibration(...)``). When the check acts depends on what was asked:

* ``budget="auto"`` (the pay-off model chose the plan): when the calibrated model-gradient error passes
  ``max_grad_error`` or the calibrated plan no longer pays (measured step speed-up ÷ predicted steps below
  ``min_gain``, ``fxapprox.passes.policy.payoff``);
* a numeric budget (the user chose the FLOPs): only when the calibrated error passes ``divergence_error``, where
  training is likely to go astray; the re-plan moves the plan off the budget no further than that threshold needs
  and the check records how far.

Each approximated layer may then take any of its own candidates that saves no more FLOPs than it does now (a
higher keep-ratio, another mode or method) or become exact, with the calibrated contributions and the measured
speed, by the same least-error allocation the plan was made with (under ``"auto"`` stopping where the predicted
gain is highest). Layers the plan left exact stay exact, so a re-plan only ever takes approximation away: checks
cannot make plans oscillate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.passes.measurement.candidates import planned_layers
from fxapprox.passes.measurement.error_model import one_draw_errors
from fxapprox.passes.policy._allocation import least_error_allocation
from fxapprox.passes.policy.budget_policy import AUTO_BUDGET, assemble_plan, decisions_for, describe_candidate
from fxapprox.passes.policy.payoff import gain_model, predicted_cost, time_saved
from fxapprox.passes.policy.policy_types import Choice, PolicySummary
from fxapprox.pipeline.records import Candidate, candidates_of, chosen_of, train_flops
from fxapprox.plan import Plan

__all__ = ["Calibration", "calibration", "predicted_families", "replan"]


def _forward(candidate: Candidate) -> bool:
    return candidate.mode == "forward"


def predicted_families(gm: torch.fx.GraphModule) -> dict:
    """What the current plan predicts for one step, by family: ``backward_step`` (squared one-draw gradient
    error of the backward family), ``output`` (squared output error of the forward family), and both families'
    effective squared contributions (``backward``, ``forward``)."""
    totals = {"backward_step": 0.0, "output": 0.0, "backward": 0.0, "forward": 0.0}
    for node in gm.graph.nodes:
        chosen = chosen_of(node)
        if chosen is None or chosen.contribution is None:
            continue
        if _forward(chosen):
            totals["forward"] += _raw(chosen, "contribution")
            totals["output"] += one_draw_errors(chosen).get("output", 0.0) ** 2
        else:
            totals["backward"] += _raw(chosen, "contribution")
            totals["backward_step"] += _raw(chosen, "step_contribution")
    return totals


def _raw(candidate: Candidate, key: str) -> float:
    """A candidate's predicted contribution as planned (a re-plan's options carry calibrated ones beside it)."""
    raw = getattr(candidate, "raw_" + key)
    if raw is not None:
        return raw
    value = getattr(candidate, key)
    return 0.0 if value is None else value


@dataclass(frozen=True)
class Calibration:
    """Measured ÷ predicted, squared, per family (1.0 where the family is absent or its prediction is 0):
    ``backward`` scales the backward family's gradient errors and extra steps; ``forward`` the forward family's
    gradient errors; ``output`` its extra steps (which are predicted from the output error)."""

    backward: float
    forward: float
    output: float = 1.0

    def scale(self, candidate: Candidate, key: str = "contribution") -> float:
        if not _forward(candidate):
            return self.backward
        return self.output if key == "step_cost" else self.forward


def calibration(predicted: dict, backward_error: float, output_error: float, memory_error: float = 0.0,
                model_error: float | None = None) -> Calibration:
    """The factors from one check's measurements (``memory_error``: the memory plan's predicted share of the
    backward family, which the re-plan does not change).

    The forward family's gradient error is mostly bias (the same kept columns step after step), so one step
    shows it whole: its measured share is what the model-gradient error has beyond the backward family's
    (errors adding in squares), against the family's predicted effective contribution."""
    def ratio(measured_sq: float, expected: float) -> float:
        return measured_sq / expected if expected > 1e-12 else 1.0
    forward_sq = output_error ** 2 if model_error is None else max(model_error ** 2 - backward_error ** 2, 0.0)
    return Calibration(ratio(backward_error ** 2, predicted["backward_step"] + memory_error ** 2),
                       ratio(forward_sq, predicted["forward"] if model_error is not None else predicted["output"]),
                       ratio(output_error ** 2, predicted["output"]))


def calibrated_error(predicted: dict, factors: Calibration) -> float:
    """The plan's effective model-gradient error with each family's contributions scaled by its factor."""
    return math.sqrt(factors.backward * predicted["backward"] + factors.forward * predicted["forward"])


def replan(gm: torch.fx.GraphModule, plan: Plan, factors: Calibration, measured_speedup: float, step: int,
           config: ApproxConfig, why: str) -> Plan:
    """The plan re-made with calibrated errors (see the module docstring); ``gm``'s meta records the new choices.

    ``measured_speedup`` corrects the planning-time speed model: the layers' measured time savings are scaled
    so that the current plan's predicted step speed-up equals the measured one.

    ``budget="auto"``: the calibrated plan must stay within ``max_grad_error`` and stops where the predicted gain
    peaks, as the plan did. A numeric budget: the least calibrated error per FLOP saved within
    ``divergence_error``, so the plan moves only as far from the budget as the divergence threshold needs.
    """
    auto = plan.budget == AUTO_BUDGET
    layers = planned_layers(gm)
    by_name = {d.node: d for d in plan.layers}
    total = sum(train_flops(n) for n in gm.graph.nodes)
    payoff = gain_model(gm, total)
    current = {n: chosen_of(n) for n in layers if by_name[n.name].approximate}
    predicted_speedup = payoff.speedup(time_saved(current), sum(train_flops(n) - c.flops
                                                                   for n, c in current.items()))
    time_scale = 1.0
    if predicted_speedup > 1.0 and measured_speedup > 0:
        time_scale = max(0.0, (1.0 - 1.0 / measured_speedup) / (1.0 - 1.0 / predicted_speedup))
    options: dict = {}
    for node, chosen in current.items():
        saving = train_flops(node) - chosen.flops
        options[node] = []
        for candidate in [chosen] + list(candidates_of(node).candidates if candidates_of(node) else ()):
            if candidate.contribution is None or candidate.blocked is not None:
                continue
            if auto and candidate is not chosen and config.min_speedup is not None and \
                    (candidate.speedup is None or candidate.speedup < config.min_speedup):
                continue   # as in the plan: only candidates measured faster than the exact op
            if train_flops(node) - candidate.flops > saving + 0.5:
                continue   # a re-plan only takes approximation away
            scale = factors.scale(candidate)
            contribution = _raw(candidate, "contribution") * scale
            options[node].append(dataclasses.replace(
                candidate, saving=train_flops(node) - candidate.flops,
                raw_contribution=_raw(candidate, "contribution"),
                raw_step_contribution=_raw(candidate, "step_contribution"),
                contribution=contribution, predicted_error=math.sqrt(contribution),
                step_contribution=_raw(candidate, "step_contribution") * scale,
                raw_step_cost=_raw(candidate, "step_cost"),
                step_cost=_raw(candidate, "step_cost") * factors.scale(candidate, "step_cost"),
                time_saving=None if candidate.time_saving is None else candidate.time_saving * time_scale))
    objective = None
    if auto and config.min_gain is not None:
        def objective(chosen, saved, squared):
            return payoff.gain(time_saved(chosen), saved, predicted_cost(chosen))
    needed = sum(train_flops(n) - c.flops for n, c in current.items())
    timed = auto and all(o.time_saving is not None for group in options.values() for o in group)
    rate = ("time_saving", "step_cost") if timed else ("saving", "contribution")
    cap = config.max_grad_error if auto else config.divergence_error
    chosen, saved, squared, _ = least_error_allocation(list(current), options, needed, cap, objective, rate)
    if objective is not None and chosen and objective(chosen, saved, squared) < config.min_gain:
        chosen, saved, squared = {}, 0.0, 0.0   # as in the plan: what does not reach min_gain stays exact
    choices = {}
    for node in layers:
        decision = by_name[node.name]
        if node not in current:
            choices[node] = Choice(None, decision.reason)
        elif node in chosen:
            option = chosen[node]
            unchanged = (option.mode, option.method, option.k) == (decision.mode, decision.method, decision.k)
            reason = decision.reason if unchanged else f"re-planned at step {step} ({why}): {describe_candidate(option)}"
            choices[node] = Choice(option, reason, option.predicted_error)
        else:
            choices[node] = Choice(None, f"re-planned at step {step} ({why}): exact")
    decisions = decisions_for(gm, layers, choices, config, measured=True)
    previous = {d.node: d for d in plan.layers}
    decisions = [dataclasses.replace(d, save_input=previous[d.node].save_input,
                                     save_input_reason=previous[d.node].save_input_reason)
                 if d.approximate and d.mode == "forward" and previous[d.node].mode == "forward" else d
                 for d in decisions]
    summary = PolicySummary(method=plan.method, squared_error=squared,
                            step_squared_error=sum(c.step_contribution for c in chosen.values()), payoff=payoff,
                            predicted_speedup=payoff.speedup(time_saved(chosen), saved),
                            predicted_steps=payoff.steps(predicted_cost(chosen)))
    sampled = sum(d.approximate for d in decisions)
    planned = (total - saved) / total if total else 1.0
    moved = "" if auto else f" (budget {plan.budget:g}: {planned - plan.achieved:+.3f} from the plan before)"
    note = (f"re-planned at step {step} ({why}): {sampled} layer(s) sampled, planned {planned:.3f} of exact training "
            f"FLOPs{moved}, calibrated model-gradient error {math.sqrt(squared):.3f}")
    if sampled:
        note += "; " + payoff.describe(time_saved(chosen), saved, predicted_cost(chosen))
    return dataclasses.replace(assemble_plan(plan.budget, plan.method, total, decisions, config, note, summary,
                                             plan.budget_met and saved >= needed - 0.5, plan.warnings),
                               memory=plan.memory, untraced=plan.untraced, regions=plan.regions,
                               auto_advice=plan.auto_advice, lowest_reachable=plan.lowest_reachable)
