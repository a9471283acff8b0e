"""What an approximated model does at training time, whatever its capture: the call path (lazy planning,
compressed saving) and the public surface (``.plan``, ``.report``, ``.history``, ``.set_approximate``); the guard's
checks are ``guard_checks.py``'s mixin, a row plan's ``row_blocks.py``'s.

:class:`ApproxRuntime` is mixed into :class:`~fxapprox.api.ApproxGraphModule` (a traced model) and into the
class of a hierarchically captured model (:mod:`fxapprox.pipeline.eager`); ``_planning_module()`` is the graph the
plan's layers are nodes of.
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import torch
import torch.fx
from torch._dynamo.comptime import comptime

from fxapprox.config import ApproxConfig
from fxapprox.errors import PlanNotReadyError
from fxapprox.passes.measurement.measure_candidates import planned_step_speedup
from fxapprox.passes.memory.memory_policy import plan_memory
from fxapprox.passes.memory.rewrite_checkpoint import checkpointed_forward
from fxapprox.passes.memory.rewrite_saved import unmarked_forward
from fxapprox.plan import Plan
from fxapprox.report import Report
from fxapprox.runtime.compiled_saving import compiled_widths
from fxapprox.runtime.guard import CheckRecord, CheckStep, TrainingHistory
from fxapprox.runtime.guard_checks import GuardRuntime, _console
from fxapprox.runtime.model_state import ModelState
from fxapprox.runtime.modules import APPROX_MODULE_TYPES, SamplingSpec
from fxapprox.runtime.row_blocks import RowRuntime
from fxapprox.runtime.saved_activations import SavedActivationStats, compressing_saved_tensors

__all__ = ["ApproxRuntime"]


def _shapes(values) -> list:
    return [list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]


def _warn_guard_not_compiled(ctx=None) -> None:
    """Run by ``comptime`` while torch.compile traces a training call (once per trace; Python's warning filter shows
    it once per process by default)."""
    warnings.warn("fxapprox: the guard (ApproxConfig(check_every=...)) does not run under torch.compile; the "
                  "compiled training step is not checked against exact gradients", RuntimeWarning, stacklevel=2)


class ApproxRuntime(GuardRuntime, RowRuntime):
    """Mixin: the training-time behaviour and public surface of an approximated model (see the module docstring).
    The class it is mixed into provides ``plan_from(*args, **kwargs)`` and ``_fxapprox_state``."""

    def _planning_module(self) -> torch.fx.GraphModule:
        """The ``GraphModule`` whose nodes the plan's layers are."""
        return self

    def __call__(self, *args, **kwargs):
        state = self._fxapprox_state
        if state.plan is None and not state.in_reference:
            self.plan_from(*args, **kwargs)
        training = state.enabled and self.training and torch.is_grad_enabled()
        if state.in_reference or not training:
            if state.exact_eval is not None and not (self.training and torch.is_grad_enabled()):
                with state.exact_eval.calling():   # the module's hooks run; its forward runs the exact graph
                    return super().__call__(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        if not torch.compiler.is_compiling():
            return self._training_call(args, kwargs)
        if state.plan.rows is not None:
            return self._rows_compiled_call(args, kwargs)
        if state.config.schedule_kind != "constant":
            # the schedule counts steps and sets keep-ratios outside the compiled graph (a graph break; a change
            # of strength recompiles); a constant plan compiles whole
            self._compiled_step(args, kwargs)
        if self._check_every() is not None and not state.warned_compile:
            # warned while torch.compile traces this call (comptime runs Python there without a graph break, so
            # fullgraph=True compiles), not from the compiled code
            comptime(_warn_guard_not_compiled)
        if state.saving is None:
            return super().__call__(*args, **kwargs)
        if not isinstance(self, torch.fx.GraphModule):
            warnings.warn("fxapprox: with a memory plan (memory_budget) the training forward of a model captured "
                          "region by region runs eagerly under torch.compile (compressed activation saving is "
                          "compiled for traced models); the sampled ops of a compute-only plan compile",
                          RuntimeWarning, stacklevel=2)
            return self._compressing_call(*args, **kwargs)
        return self._compiled_compressing_call(args, kwargs)

    def _begin_step(self, args, kwargs) -> int:
        """Count a training step; close a check whose backward never ran; re-plan the memory when due."""
        state = self._fxapprox_state
        check = state.check
        if check is not None:
            check.cancel()
            state.check = None
        state.training_steps += 1
        self._follow_schedule(state.training_steps)
        every = state.config.activation_replan_every
        if every and state.training_steps % every == 0 and state.memory_budget is not None \
                and state.saving is not None:
            self.replan_memory(*args, **kwargs)
        return state.training_steps

    def _plain_call(self, args, kwargs):
        """The module's own call (its hooks included), past planning and the guard."""
        return super(ApproxRuntime, self).__call__(*args, **kwargs)

    @torch._dynamo.disable
    def _rows_compiled_call(self, args, kwargs):
        # A row-sampled block chooses its rows in backward and replays itself on them: its training step runs
        # eagerly under torch.compile (a graph break around the model's call); the rest of a compiled program
        # compiles.
        state = self._fxapprox_state
        if not state.warned_compile:
            state.warned_compile = True
            warnings.warn("fxapprox: a row-sampled plan's training step runs eagerly under torch.compile (its blocks "
                          "choose their rows in backward); evaluation compiles", RuntimeWarning, stacklevel=3)
        return self._training_call(args, kwargs)

    def _record_row_check(self, step: int, check, action: str, note: str) -> None:
        """Append a row plan's variance check to ``history`` (and print it with ``check_verbose``)."""
        state = self._fxapprox_state
        rows = state.plan.rows
        record = CheckRecord(step=step, model_error=check.draw_error, predicted_error=None,
                             backward_error=check.draw_error, predicted_backward_error=0.0, output_error=0.0,
                             predicted_output_error=0.0, calibrated_error=check.draw_error,
                             alignment=check.draw_cosine, cosine=check.draw_cosine,
                             exact_seconds=check.exact_seconds, approx_seconds=check.sampled_seconds,
                             action=action, note=note, planned_flops=state.plan.achieved,
                             noise_scale=check.noise_scale, strength=state.strength,
                             row_ratio=min((b.ratio for b in rows.sampled), default=1.0),
                             token_ratio=rows.token_ratio, sgd_variance=check.sgd_variance,
                             row_variance=check.row_variance, token_variance=check.token_variance,
                             checked_ratio=check.ratio, checked_token_ratio=check.token_ratio,
                             check_seconds=check.seconds)
        state.history.append(record)
        if state.config.check_verbose:
            _console().print(record.line(), highlight=False)

    def _training_call(self, args, kwargs):
        state = self._fxapprox_state
        step = self._begin_step(args, kwargs)
        if state.plan.rows is not None:
            return self._rows_training_call(step, args, kwargs)
        if state.saving is not None:
            def call():
                return self._compressed_forward(args, kwargs)
        else:
            def call():
                return super(ApproxRuntime, self).__call__(*args, **kwargs)
        if not self._check_due(step):
            return call()
        plan = self.plan
        forward = any(d.mode == "forward" for d in plan.approximated)
        backward = any(d.mode != "forward" for d in plan.approximated) or plan.memory is not None
        check = CheckStep(self, args, kwargs, self._reference_call, lambda measured: self._checked(step, measured),
                          replay=forward and backward)
        state.check = check
        return check.run(call)

    @torch._dynamo.disable
    def _compiled_step(self, args, kwargs) -> None:
        if self._fxapprox_state.saving is None:   # the compressing call counts its own steps
            self._begin_step(args, kwargs)

    @torch._dynamo.disable
    def _compressing_call(self, *args, **kwargs):
        # Eager under torch.compile (a graph break here): the pack hooks key saved tensors by storage and the
        # markers tag graph values as they are made, neither of which survives inductor's rewriting of the
        # forward and of what it saves.
        self._begin_step(args, kwargs)
        return self._compressed_forward(args, kwargs)

    @torch._dynamo.disable(recursive=False)
    def _compiled_compressing_call(self, args, kwargs):
        # Saved-tensor hooks can only be pushed outside a compiled frame: this frame runs eagerly (a graph break),
        # the hooks go on in a frame dynamo does not enter, and the module's forward, a frame of its own,
        # compiles with them in force — AOTAutograd inlines them into its forward and backward graphs
        # (fxapprox.runtime.compiled_saving).
        hooks = self._enter_compiled_saving(args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._exit_compiled_saving(hooks)

    @torch._dynamo.disable
    def _enter_compiled_saving(self, args, kwargs):
        self._begin_step(args, kwargs)
        saving, forward = self._compiled_saving()
        hooks = saving.hooks()
        hooks.__enter__()
        # an instance attribute shadows the generated ``forward`` for this call only
        self.__dict__["forward"] = types.MethodType(forward, self)
        return hooks

    @torch._dynamo.disable
    def _exit_compiled_saving(self, hooks) -> None:
        self.__dict__.pop("forward", None)
        hooks.__exit__(None, None, None)

    def _compiled_saving(self):
        """The :class:`~fxapprox.runtime.compiled_saving.CompiledSaving` and the training forward without marker
        nodes, built from the graph and plan as they stand and kept until either changes (a new forward would
        recompile). The widths are those of the values-only memory plan: under ``torch.compile`` the compiler's
        partitioner decides what backward recomputes, so blocks are not checkpointed."""
        state = self._fxapprox_state
        memory = state.plan.memory
        source = (self.code, memory)
        cached = state.compiled_saving
        if cached is None or cached[0][0] is not source[0] or cached[0][1] is not source[1]:
            values_only = plan_memory(self, state.memory_budget, state.memory_config) if memory.checkpointed \
                else memory
            state.compiled_saving = (source, (compiled_widths(values_only, state.memory_config or state.config),
                                              unmarked_forward(self)))
        return state.compiled_saving[1]

    def _compressed_forward(self, args, kwargs):
        state = self._fxapprox_state
        forward = self._checkpointed_forward()
        with compressing_saved_tensors(state.saving, self) as compressor:
            if forward is None:
                output = super().__call__(*args, **kwargs)
            else:
                # The module's own call (its hooks included) around the checkpointed copy of the graph: an
                # instance attribute shadows the generated ``forward`` for this call only.
                self.__dict__["forward"] = types.MethodType(forward, self)
                try:
                    output = super().__call__(*args, **kwargs)
                finally:
                    del self.__dict__["forward"]
        state.saved_stats = compressor.stats()
        return output

    def _checkpointed_forward(self):
        """The training forward of a memory plan that checkpoints blocks
        (``fxapprox.passes.memory.rewrite_checkpoint``), built from the graph as it stands and kept until the graph
        changes; ``None`` when no block is checkpointed."""
        state = self._fxapprox_state
        memory = state.plan.memory if state.plan is not None else None
        if memory is None or not memory.checkpointed or not isinstance(self, torch.fx.GraphModule):
            return None
        source = (self.code, memory)   # the graph and the plan it was built from (a rank may adopt rank 0's)
        cached = state.checkpointed
        if cached is None or cached[0][0] is not source[0] or cached[0][1] is not source[1]:
            state.checkpointed = (source, checkpointed_forward(self, memory.checkpointed, state.saving))
        return state.checkpointed[1]

    # -- the guard ------------------------------------------------------------------------------
    def _apply_plan(self, plan: Plan) -> None:
        """Give every approximated module its decision's spec (``k = n``: exact); parameters stay the same
        objects, so the optimizer's state and the state_dict keys are untouched."""
        state = self._fxapprox_state
        planning = self._planning_module()
        nodes = {n.name: n for n in planning.graph.nodes}
        for decision in plan.layers:
            node = nodes.get(decision.node)
            if node is None or node.op != "call_module":
                continue
            module = planning.get_submodule(node.target)
            if not isinstance(module, APPROX_MODULE_TYPES):
                continue
            spec = module.fxapprox_spec
            if decision.approximate:
                # the schedule's strength scales the dropped pairs (fxapprox.schedule); n kept pairs: exact
                k = decision.n - round(state.strength * (decision.n - decision.k))
                module.fxapprox_spec = SamplingSpec(method=decision.method, k=max(1, k), n=decision.n,
                                                    mode=decision.mode, random_share=decision.random_share,
                                                    save_input=decision.save_input or "reference")
            else:
                module.fxapprox_spec = dataclasses.replace(spec, k=spec.n)
        state.plan = plan
        state.report = Report(plan, state.model_name, state.report.input_shapes, state.history)
        self._sync_rows()

    # -- the schedule over training -------------------------------------------------------------------
    @property
    def executed_flops(self) -> float:
        """Training FLOPs the steps so far executed as a fraction of exact training's (the schedule's strengths
        counted; 1.0 before the first step).

        Example::

            >>> approx.executed_flops    # e.g. 0.625: the plan at 0.5 for 750 steps, exact for 250
        """
        state = self._fxapprox_state
        return state.executed_flops_sum / state.training_steps if state.training_steps else 1.0

    # -- public surface ---------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The :class:`~fxapprox.plan.Plan` (available once planned)."""
        plan = self._fxapprox_state.plan
        if plan is None:
            raise PlanNotReadyError(
                "no plan yet: it is made on the first batch the module sees; run one forward pass "
                "or pass example_inputs= to fxapprox.approximate")
        return plan

    @property
    def report(self) -> Report:
        """The rewrite :class:`~fxapprox.report.Report` (available once planned)."""
        self.plan  # noqa: B018 — raises the explanatory error when not planned yet
        return self._fxapprox_state.report

    @property
    def saved_activation_stats(self) -> SavedActivationStats | None:
        """What the last compressing training forward kept for backward (``None`` before one ran).

        Example::

            >>> approx(x).sum().backward()
            >>> approx.saved_activation_stats.ratio     # e.g. 7.6 (times fewer bytes) at 4 bits
        """
        return self._fxapprox_state.saved_stats

    @property
    def history(self) -> TrainingHistory:
        """The guard's checks so far (:class:`~fxapprox.runtime.guard.TrainingHistory`; empty when ``check_every`` is
        ``None`` or nothing was trained yet).

        Example::

            >>> approx.history[-1].model_error, approx.history[-1].speedup
            >>> json.dumps(approx.history.to_dict())
        """
        return self._fxapprox_state.history

    @property
    def planned(self) -> bool:
        return self._fxapprox_state.plan is not None

    def set_approximate(self, enabled: bool) -> "ApproxRuntime":
        """Switch approximation on (``True``) or off (``False``, exact training); returns ``self``.

        Example::

            >>> approx.set_approximate(False)   # e.g. the last epochs exact
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        self._fxapprox_state.enabled = enabled
        for module in self.modules():
            if isinstance(module, APPROX_MODULE_TYPES):
                module.fxapprox_enabled = enabled
        self._sync_rows()   # a region-captured model's blocks hold the sampler: switch it too
        return self

    def _set_sampling(self, enabled: bool) -> None:
        """Switch every sampled op on or off without changing ``set_approximate``'s setting (the planned step's
        timing compares the two)."""
        self._fxapprox_state.rows_off = not enabled
        for module in self.modules():
            if isinstance(module, APPROX_MODULE_TYPES):
                module.fxapprox_enabled = enabled

    def _measure_planned_step(self, plan: Plan, inputs, forward) -> Plan:
        """``plan`` with its step speed-up measured on the example batch, where the measured policy timed its
        candidates and something is sampled."""
        config: ApproxConfig = self._fxapprox_state.config
        if not plan.approximated or config.policy != "measured" or config.min_speedup is None:
            return plan
        if plan.rows is not None and not plan.rows.saved_flops:   # "auto" before its first check: nothing sampled
            return plan
        speedup = planned_step_speedup(self, inputs, forward, self._set_sampling, plan.fingerprint(), config)
        return plan.with_measured_speedup(speedup)

    def _portable_state(self) -> ModelState:
        """The state without the check in flight (its hooks belong to this module's tensors)."""
        return self._fxapprox_state.portable()
