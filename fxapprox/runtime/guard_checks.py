"""The guard at training time (``ApproxConfig(check_every=...)``): when a check is due, the exact reference pass, what
a check measured and what the plan does about it (keep, re-plan, calibrate), and the approximation schedule the
checks steer (``schedule="noise"``). A mixin of :class:`~fxapprox.runtime.model.ApproxRuntime`, which provides the
call path and ``_fxapprox_state``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.passes.guard.replan import calibrated_error, calibration, predicted_families, replan
from fxapprox.passes.measurement.candidates import parameterised
from fxapprox.passes.policy.payoff import gain_model
from fxapprox.pipeline.ranks import mean_over_ranks, plan_of_rank_zero
from fxapprox.plan import Plan
from fxapprox.runtime.guard import CheckRecord, LayerCheck, alignment_and_cosine, gradient_errors, owner_groups
from fxapprox.runtime.modules import APPROX_MODULE_TYPES
from fxapprox.schedule import NoiseScale, ScheduleRecord, schedule_strength, step_fraction

__all__ = ["GuardRuntime"]


def _console():
    from rich.console import Console

    return Console(stderr=True)


class GuardRuntime:
    """Mixin: the guard's checks and the schedule they steer (see the module docstring)."""

    def _check_every(self) -> int | None:
        return self._fxapprox_state.config.check_every

    def _check_due(self, step: int) -> bool:
        every = self._check_every()
        if every is None:
            return False
        state = self._fxapprox_state
        # schedule="noise" checks in pairs (the step after a check too): two batches' exact gradients at nearly the
        # same weights give the noise scale
        paired = state.config.schedule_kind == "noise" and every > 1 and step % every == 1 and step > 1
        if step % every and not paired:
            return False
        plan = self.plan
        sampling = bool(plan.approximated) and state.strength > 0
        return sampling or (plan.memory is not None and bool(plan.memory.compressed or plan.memory.recomputed))

    def _reference_call(self, args, kwargs, aliases, keep_forward: bool = False):
        """The model on ``aliases`` of its parameters, exact (the guard's reference pass) or, with
        ``keep_forward``, with only the forward-sampled layers sampled (no compressed activations either)."""
        state = self._fxapprox_state
        modules = [m for m in self.modules() if isinstance(m, APPROX_MODULE_TYPES)]
        flags = [m.fxapprox_enabled for m in modules]
        for module in modules:
            module.fxapprox_enabled = module.fxapprox_enabled and keep_forward \
                and module.fxapprox_spec.mode == "forward"
        state.in_reference = True
        try:
            return torch.func.functional_call(self, aliases, args, kwargs, strict=False)
        finally:
            state.in_reference = False
            for module, flag in zip(modules, flags):
                module.fxapprox_enabled = flag

    def _layer_parameters(self, decision) -> list[str]:
        """Names of the parameters an approximated layer's weight gradient is measured on."""
        planning = self._planning_module()
        node = next((n for n in planning.graph.nodes if n.name == decision.node), None)
        if node is None:
            return []
        names = []
        if node.op == "call_module":
            module = planning.get_submodule(node.target)
            names += [f"{node.target}.{name}" for name, p in module.named_parameters(recurse=False)
                      if p.requires_grad]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and parameterised(planning, arg):
                names.append(arg.target)
        return names

    def _checked(self, step: int, measured: dict) -> None:
        """Turn one check's gradients into a :class:`~fxapprox.runtime.guard.CheckRecord` and act on it: re-plan when
        the calibrated error passes the tolerance or the plan is no longer predicted to pay."""
        state = self._fxapprox_state
        state.check = None
        plan = self.plan
        config: ApproxConfig = state.config
        exact, approx, replay = measured["exact"], measured["approx"], measured["replay"]
        groups = owner_groups(exact)
        model_error, _ = gradient_errors(exact, approx, groups)
        forward = any(d.mode == "forward" for d in plan.approximated)
        if replay is not None:
            backward_error = gradient_errors(replay, approx, groups)[0]
        else:
            backward_error = 0.0 if forward else model_error
        families = predicted_families(self._planning_module())
        memory_error = plan.memory.predicted_error if plan.memory is not None else None
        layers = []
        for decision in plan.approximated:
            names = self._layer_parameters(decision)
            _, errors = gradient_errors(exact, approx, {decision.target: names}) if names else (0.0, {})
            layers.append(LayerCheck(node=decision.node, target=decision.target, method=decision.method,
                                     mode=decision.mode, keep_ratio=decision.keep_ratio,
                                     planned_error=decision.isolated_grad_error,
                                     measured_error=errors.get(decision.target)))
        alignment, cosine = alignment_and_cosine(exact, approx)
        # Under DDP each rank checked its own shard of the batch: every rank acts on the ranks' mean, so all make
        # the same decision and the plans stay in agreement.
        model_error, backward_error, output_error, exact_seconds, approx_seconds = mean_over_ranks(
            [model_error, backward_error, measured["output_error"], measured["exact_seconds"],
             measured["approx_seconds"]], next(iter(self.parameters())).device)
        factors = calibration(families, backward_error, output_error, memory_error or 0.0, model_error)
        calibrated = math.hypot(calibrated_error(families, factors),
                                math.sqrt(factors.backward) * (memory_error or 0.0))
        record = CheckRecord(step=step, model_error=model_error, predicted_error=plan.predicted_step_error,
                             backward_error=backward_error,
                             predicted_backward_error=math.sqrt(families["backward_step"] + (memory_error or 0) ** 2),
                             output_error=output_error,
                             predicted_output_error=math.sqrt(families["output"]),
                             calibrated_error=calibrated, alignment=alignment, cosine=cosine,
                             exact_seconds=exact_seconds, approx_seconds=approx_seconds,
                             layers=tuple(layers), planned_flops=plan.achieved, strength=state.strength)
        record = self._follow_noise(self._act_on_check(record, factors), exact)
        state.history.append(record)
        if config.check_verbose:
            _console().print(record.line(), highlight=False)

    def _act_on_check(self, record: CheckRecord, factors) -> CheckRecord:
        """Re-plan when the check says so (``passes/guard/replan.py``: under ``budget="auto"`` past
        ``max_grad_error`` or when the plan no longer pays, under a numeric budget only past ``divergence_error``); the
        record says what was done and why."""
        state = self._fxapprox_state
        config: ApproxConfig = state.config
        plan = self.plan
        auto = plan.budget == "auto"
        payoff = gain_model(self._planning_module(), plan.total_exact_flops)
        # Speed: the median of the measured speed-ups since the last re-plan (the first check's step may still pay
        # one-off costs: left out once there are others). Measured values only: under DDP they are the ranks'
        # mean, so every rank decides alike.
        since = []
        for previous in state.history.records:
            since = [] if previous.action == "replanned" else since + [previous.speedup]
        speeds = (since[1:] if len(since) > 1 else since) + [record.speedup]
        speedup = statistics.median(speeds)
        why = []
        threshold, name = (config.max_grad_error, "max_grad_error") if auto else \
            (config.divergence_error, "divergence_error")
        if threshold is not None and record.calibrated_error > threshold:
            why.append(f"calibrated model-gradient error {record.calibrated_error:.3f} > {name} {threshold:g}")
        gain = None
        if plan.approximated:
            # Steps from what this step measured: each family's error squared times its cost (passes/policy/payoff.py).
            backward_cost, forward_cost = config.error_costs
            steps = payoff.steps(backward_cost * record.backward_error ** 2 + forward_cost * record.output_error ** 2)
            gain = speedup / steps
            if auto and config.min_gain is not None and gain < config.min_gain:
                why.append(f"{speedup:.2f}x faster per step but {steps:.2f}x the steps: {gain:.2f}x < min_gain "
                           f"{config.min_gain:g}")
        if not why or not plan.approximated:
            note = ("within the tolerance" if auto else "below divergence_error") + (
                "" if gain is None else f", predicted {gain:.2f}x sooner to a given loss" if gain >= 1 else
                f", predicted {1 / gain:.2f}x later to a given loss")
            return dataclasses.replace(record, note=note if plan.approximated else "nothing sampled")
        if not config.check_replan:
            return dataclasses.replace(record, action="measured", note="; ".join(why) + " (check_replan=False)")
        if plan.predicted_error is None:   # only the measured policy's candidates carry the errors a re-plan needs
            return dataclasses.replace(record, action="measured",
                                       note="; ".join(why) + " (policy='flops' plans are not re-planned)")
        planning = self._planning_module()
        new = self._with_schedule(plan_of_rank_zero(planning, replan(planning, plan, factors, speedup, record.step,
                                                                     config, "; ".join(why))))
        self._apply_plan(new)
        changed = [d for d, old in zip(new.layers, plan.layers)
                   if (d.approximate, d.mode, d.method, d.k) != (old.approximate, old.mode, old.method, old.k)]
        summary = ", ".join(f"{d.target} {'exact' if not d.approximate else f'{d.mode} {d.method} {d.keep_ratio:.2f}'}"
                            for d in changed) or "no layer changed"
        moved = "" if auto else (f"; the plan moved from {plan.achieved:.3f} to {new.achieved:.3f} of exact training "
                                 f"FLOPs (budget {plan.budget:g})")
        return dataclasses.replace(record, action="replanned", planned_flops=new.achieved,
                                   note="; ".join(why) + f" → {summary}{moved}")

    def _follow_noise(self, record: CheckRecord, exact: dict) -> CheckRecord:
        """``schedule="noise"``: on the second check of a pair, update the noise scale from the two exact
        gradients and lower the strength where the scale calls for it (``fxapprox.schedule.NoiseScale``)."""
        state = self._fxapprox_state
        config: ApproxConfig = state.config
        if config.schedule_kind != "noise":
            return record
        pending, state.noise_pending = state.noise_pending, None
        if pending is None or pending[0] != record.step - 1:
            state.noise_pending = (record.step, exact)
            return dataclasses.replace(record, strength=state.strength)
        previous = pending[1]
        inner = squares = 0.0
        for name, gradient in exact.items():
            other = previous.get(name)
            if gradient is None or other is None:
                continue
            gradient, other = gradient.double(), other.double()
            inner += float((gradient * other).sum())
            squares += 0.5 * float(gradient.pow(2).sum() + other.pow(2).sum())
        inner, squares = mean_over_ranks([inner, squares], next(iter(self.parameters())).device)
        if state.noise is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            state.noise = NoiseScale(ranks=torch.distributed.get_world_size() if distributed else 1)
        state.noise.update(inner, squares)
        plan = self.plan
        speedup = plan.measured_speedup or plan.predicted_speedup or record.speedup
        before = state.strength
        self._set_strength(state.noise.strength(before, speedup, plan.achieved))
        ratio = state.noise.ratio
        note = (f"gradient noise scale B_noise/B {ratio:.3g}: "
                + (f"strength {before:g} → {state.strength:g}" if state.strength != before
                   else f"strength {before:g} kept"))
        return dataclasses.replace(record, noise_scale=ratio, strength=state.strength,
                                   note="; ".join(filter(None, [record.note, note])))
    def _with_schedule(self, plan: Plan) -> Plan:
        """``plan`` with the schedule it runs under (``ApproxConfig(schedule=..., total_steps=...)``)."""
        config: ApproxConfig = self._fxapprox_state.config
        record = ScheduleRecord.of(config.schedule_kind, config.total_steps, config.exact_fraction, plan.achieved)
        return dataclasses.replace(plan, schedule=record.to_dict())

    def _follow_schedule(self, step: int) -> None:
        """Set the strength of training step ``step`` (step-driven schedules) and count its FLOPs."""
        state = self._fxapprox_state
        config: ApproxConfig = state.config
        plan = state.plan
        if plan is None:
            return
        kind = config.schedule_kind
        if kind in ("mixed", "anneal"):
            self._set_strength(schedule_strength(kind, step, config.total_steps, config.exact_fraction))
        state.executed_flops_sum += step_fraction(state.strength, plan.achieved)

    def _set_strength(self, strength: float) -> None:
        state = self._fxapprox_state
        if strength != state.strength:
            state.strength = strength
            self._apply_plan(state.plan)
