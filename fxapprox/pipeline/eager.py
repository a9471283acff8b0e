"""A model whose own code torch.fx cannot trace, approximated region by region (hierarchical capture).

:func:`approximate_eager` returns a copy of the user's model *of its own class* (Hugging Face's ``generate``,
``config``, ``save_pretrained`` keep working) whose traced regions are ``GraphModule`` s and whose approximable
leaves in eager code are swapped in place (:mod:`fxapprox.passes.capture.regions`). The class is a subclass made on the
fly with :class:`ApproxModel` mixed in, under the original's name: ``isinstance`` checks and the ``architectures``
Hugging Face writes are those of the original class.

Planning (on the first batch, or ``example_inputs``) runs the model once to record each region's inputs, counts
the eager code's FLOPs over one real step, stitches the regions into one planning graph
(:mod:`fxapprox.passes.capture.stitch`), runs the same passes as for a traced model on it — one budget over the whole
model — and puts the rewritten regions back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

from torch import nn

from fxapprox.config import ApproxConfig
from fxapprox.passes.analysis.rank import rank_layers
from fxapprox.passes.capture.eager_flops import count_eager_flops, count_step_flops
from fxapprox.passes.capture.eager_saved import count_eager_saved_bytes
from fxapprox.passes.capture.regions import Region, capture_regions, record_calls
from fxapprox.passes.capture.stitch import EagerCode, install_regions, stitch, stitched_loss
from fxapprox.passes.measurement.candidates import enumerate_candidates
from fxapprox.passes.measurement.measure_candidates import (EXACT_STEP_KEY, _device_of, cached_step_seconds,
                                                            measure_candidates)
from fxapprox.passes.memory.blocks import MemoryTimings
from fxapprox.passes.memory.measure_blocks import pack_timings
from fxapprox.passes.memory.region_blocks import find_region_blocks, region_recompute_seconds
from fxapprox.passes.policy.budget_policy import AUTO_BUDGET
from fxapprox.passes.rewrite import rewrite_sampled_ops
from fxapprox.pipeline.analysis import analyse, measurement_sandbox
from fxapprox.pipeline.compute_plan import make_compute_plan
from fxapprox.pipeline.memory_planning import memory_planned, plan_saved_activations
from fxapprox.pipeline.row_planning import forward_sampling_harmless, make_row_plan, row_planned
from fxapprox.passes.analysis.row_blocks import find_row_blocks, row_blocks_of
from fxapprox.passes.measurement.measure_rows import eager_block_runs
from fxapprox.pipeline.timing_cache import TimingCache
from fxapprox.pipeline.records import EAGER_COPY_KEY, EAGER_SAVED_KEY, FLOPS_KEY, FlopCount, flops_of
from fxapprox.plan import Plan
from fxapprox.report import Report
from fxapprox.runtime.model import ApproxRuntime, _shapes
from fxapprox.runtime.model_state import ModelState, check_loaded
from fxapprox.runtime.checkpointing import RegionCheckpoint
from fxapprox.runtime.saved_markers import EagerCopies

__all__ = ["ApproxModel", "approximate_eager"]


class ApproxModel(ApproxRuntime):
    """Mixed into the user's model class for a hierarchically captured model (see the module docstring)."""

    _fxapprox_state: ModelState

    def _planning_module(self):
        planning = self._fxapprox_state.planning
        if planning is None:
            self.plan  # noqa: B018 — raises the explanatory error when not planned yet
        return planning

    def plan_from(self, *args, **kwargs) -> Plan:
        """Analyse, plan and rewrite the regions using these inputs (done once; the first batch does it lazily)."""
        state = self._fxapprox_state
        if state.plan is not None:
            raise RuntimeError("this module is already planned; call fxapprox.approximate again to re-plan")
        config: ApproxConfig = state.config
        with measurement_sandbox(self), self._exact_calls():
            received = record_calls(self, args, kwargs)
            capture = capture_regions(self, Region.from_dict(state.root), received, config.leaf_modules)
            forward_flops, step_flops = count_step_flops(self, args, kwargs)
            eager_saved = (count_eager_saved_bytes(self, capture, args, kwargs, config.activation_min_bytes,
                                                   config.activation_group_size)
                           if memory_planned(state.memory_budget, config) else {})
        planning, inputs = stitch(self, capture, received)
        analyse(planning, inputs, progress=config.progress)
        for node in planning.graph.find_nodes(op="call_function", target=stitched_loss):   # not the model's
            node.meta[FLOPS_KEY] = FlopCount()
        regions_backward = sum(flops_of(n).backward for n in planning.graph.nodes)
        eager_flops = count_eager_flops(capture, forward_flops, step_flops.get("", 0), regions_backward)
        for node in planning.graph.nodes:
            if isinstance(node.target, EagerCode):
                node.meta[FLOPS_KEY] = FlopCount(*eager_flops.get(node.target.path, (0, 0)))
                saved = eager_saved.get(node.target.path)
                node.meta[EAGER_SAVED_KEY] = saved.exact_bytes if saved else 0
                node.meta[EAGER_COPY_KEY] = saved.copied_bytes if saved else 0
        rank_layers(planning)
        enumerate_candidates(planning, state.method, config)
        plan, why_not_rows = None, None
        if row_planned(state, config):
            with measurement_sandbox(self), self._exact_calls():
                has_blocks = bool(find_row_blocks(planning))
                if has_blocks:
                    why_not_rows = forward_sampling_harmless(
                        lambda: super(ApproxRuntime, self).__call__(*args, **kwargs), state, config)
                if has_blocks and why_not_rows is None:
                    runs, unrunnable = eager_block_runs(self, planning, received)
                    plan, why_not_rows = make_row_plan(planning, state, config, runs, unrunnable)
        if plan is None:
            if config.policy == "measured" and (state.budget == AUTO_BUDGET or state.budget < 1.0):
                with measurement_sandbox(planning):
                    measure_candidates(planning, *inputs, config=config, progress=config.progress)
                if EXACT_STEP_KEY in planning.meta:   # the whole model's step, eager code included
                    with measurement_sandbox(self), self._exact_calls():
                        planning.meta[EXACT_STEP_KEY] = cached_step_seconds(
                            self, (args, kwargs), lambda: super(ApproxRuntime, self).__call__(*args, **kwargs),
                            config)
            plan = make_compute_plan(planning, inputs, state, config)
            if why_not_rows and row_blocks_of(planning):
                plan = dataclasses.replace(plan, note=f"{plan.note}; row sampling not used: {why_not_rows}")
        plan = dataclasses.replace(plan, regions=tuple(r.to_dict() for r in capture.regions),
                                   untraced=tuple(dict(u) for u in state.untraced))
        rewrite_sampled_ops(planning, plan)
        if memory_planned(state.memory_budget, config):
            def region_blocks(values, largest):
                blocks = find_region_blocks(planning, inputs, capture, received, values)
                if not blocks:
                    return (), None
                with measurement_sandbox(self), self._exact_calls():
                    step = cached_step_seconds(self, (args, kwargs),
                                               lambda: super(ApproxRuntime, self).__call__(*args, **kwargs), config)
                    recompute = region_recompute_seconds(self, blocks, received, config)
                cache = TimingCache.for_config(config.timing_cache, _device_of(inputs))
                pack = pack_timings(largest, _device_of(inputs), config, cache)
                cache.save()
                return tuple(blocks), MemoryTimings(step, recompute, pack)

            plan = plan_saved_activations(planning, inputs, plan, state, config, region_blocks=region_blocks)
        install_regions(self, planning, capture)
        if plan.memory is not None:
            for block in plan.memory.checkpointed:
                module = self.get_submodule(block.name)
                module.forward = RegionCheckpoint(module)
        if plan.memory is not None and plan.memory.eager_copy_bits is not None:
            copies = EagerCopies(plan.memory.eager_copy_bits, config.activation_min_bytes)
            for region in capture.regions:
                hooks = copies if region.kind == "eager" else EagerCopies(None, 0)
                hooks.install(self.get_submodule(region.path))
        state.planning = planning
        step = lambda: super(ApproxRuntime, self).__call__(*args, **kwargs)  # noqa: E731
        if plan.rows is not None:
            state.plan = plan
            step = lambda: self._row_call(lambda: super(ApproxRuntime, self).__call__(*args, **kwargs))  # noqa: E731
        with measurement_sandbox(self), self._exact_calls():
            plan = self._measure_planned_step(plan, (args, kwargs), step)
        plan = self._with_schedule(plan)
        state.plan = plan
        state.report = Report(plan, state.model_name, _shapes(args) + _shapes(kwargs.values()),
                                 state.history)
        self.set_approximate(state.enabled)
        return plan

    @contextlib.contextmanager
    def _exact_calls(self):
        """Calls of the model run its own forward (no planning, no guard) while it is being planned."""
        state = self._fxapprox_state
        state.in_reference = True
        try:
            yield
        finally:
            state.in_reference = False

    def replan_memory(self, *args, **kwargs) -> Plan:
        raise NotImplementedError("replan_memory is not available on a hierarchically captured model (its regions' "
                                  "inputs would have to be recorded again): its memory plan is made once")

    def __deepcopy__(self, memo):
        check = self._fxapprox_state.check
        if check is not None:   # the check in flight holds the batch and hooks of this module's tensors
            memo[id(check)] = None
        body = {key: value for key, value in self.__dict__.items() if key != "_fxapprox_state"}
        result = _rebuild_eager(_user_class(type(self)), copy.deepcopy(body, memo))
        memo[id(self)] = result
        result._fxapprox_state = copy.deepcopy(self._portable_state(), memo)
        return result

    def __reduce__(self):
        # The class is made on the fly: pickle the user's class and make the subclass again on load. The planning
        # graph is a RecordedGraphModule: it pickles as records (GraphModule's own pickling re-imports its targets
        # by name, which the eager code's stand-ins have none of).
        body = dict(self.__dict__)
        body["_fxapprox_state"] = self._portable_state()
        return (_rebuild_eager, (_user_class(type(self)), body))


_CLASSES: dict[type, type] = {}


def _approx_class(user_class: type) -> type:
    """The subclass of ``user_class`` with :class:`ApproxModel` mixed in (one per user class), under its name."""
    if user_class not in _CLASSES:
        _CLASSES[user_class] = type(user_class.__name__, (ApproxModel, user_class),
                                    {"__module__": user_class.__module__, "__qualname__": user_class.__qualname__,
                                     "_fxapprox_user_class": user_class})
    return _CLASSES[user_class]


def _user_class(approx_class: type) -> type:
    return approx_class._fxapprox_user_class


def _rebuild_eager(user_class: type, body: dict) -> nn.Module:
    check_loaded(body)
    model = user_class.__new__(_approx_class(user_class))
    model.__dict__.update(body)
    return model


def approximate_eager(model: nn.Module, root: Region, *, budget, memory_budget, method: str, config: ApproxConfig,
                      model_name: str, untraced: tuple = ()) -> nn.Module:
    """A copy of ``model`` captured region by region; ``root`` says why its own code runs eagerly (it failed to
    trace, or submodules holding approximable layers did: ``untraced``, their
    :class:`~fxapprox.passes.capture.trace.UntracedModule` s)."""
    if config.activation_replan_every is not None and memory_planned(memory_budget, config):
        hidden = [u.module for u in untraced]
        fix = (f"mark {', '.join(hidden)} leaf_modules (they then stay exact)" if hidden
               else "trace the model yourself and pass the GraphModule")
        raise NotImplementedError(
            f"activation_replan_every: {model_name} is captured region by region ({root.reason}); its memory plan "
            f"is made once (replan_memory is not available on a hierarchically captured model). Leave "
            f"activation_replan_every=None, or {fix}")
    copied = copy.deepcopy(model)
    copied.__class__ = _approx_class(type(copied))
    copied._fxapprox_state = ModelState(budget=budget, memory_budget=memory_budget, method=method, config=config,
                                        model_name=model_name, root=root.to_dict(),
                                        untraced=tuple(u.to_dict() for u in untraced))
    return copied
