"""The saved-activations stage of planning, on a (rewritten) planning graph: the passes that choose what each
saved value keeps, run in the order they need. Shared by a traced model and a region-captured one."""

from __future__ import annotations

import dataclasses

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.ops.attention import as_in_compressed_training
from fxapprox.passes.analysis.saved_bytes import measure_saved_bytes
from fxapprox.passes.memory.attention_recompute import recompute_attention
from fxapprox.passes.memory.blocks import find_blocks
from fxapprox.passes.memory.compact_pooling import compact_max_pools
from fxapprox.passes.measurement.measure_candidates import cached_step_seconds
from fxapprox.passes.memory.measure_blocks import measure_memory_options, measure_memory_step
from fxapprox.passes.memory.measure_saved import measure_saved_values
from fxapprox.passes.memory.memory_policy import calibrated_timings, memory_candidates, plan_memory, resolve_recompute
from fxapprox.passes.memory.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.memory.saved_values import saved_values
from fxapprox.pipeline.analysis import measurement_sandbox
from fxapprox.plan import MemoryPlan, Plan
from fxapprox.runtime.model_state import ModelState
from fxapprox.runtime.saved_activations import SavingOptions

__all__ = ["choose_memory_plan", "memory_planned", "plan_saved_activations"]


def memory_planned(memory_budget: float | None, config: ApproxConfig) -> bool:
    """Whether a memory plan is asked for."""
    return config.activation_bits is not None or (memory_budget is not None and memory_budget < 1.0)


def choose_memory_plan(gm: torch.fx.GraphModule, inputs: tuple, memory_budget: float | None, config: ApproxConfig,
                       checkpoint_blocks: bool, region_blocks=None) -> MemoryPlan | None:
    """Measure what the memory policy weighs — each value's gradient cost at 8/4/2 bits, and with
    ``checkpoint_blocks`` each block's recompute time and the packer's — and plan (``gm``'s saved bytes measured,
    no marker in it). ``config`` is the memory config (``activation_recompute`` resolved). A region-captured model
    passes ``region_blocks(values, largest)``: its blocks and their :class:`MemoryTimings` (measured on the model,
    not on ``gm``, whose regions are not connected); its values-only plan's packing is calibrated on ``gm``."""
    blocks, timings = (), None
    checkpointing = (checkpoint_blocks or region_blocks is not None) and config.activation_checkpoint \
        and config.activation_bits is None and memory_budget is not None and memory_budget < 1.0
    with measurement_sandbox(gm), as_in_compressed_training():
        candidates = memory_candidates(gm, config)
        if config.activation_policy == "measured" and config.activation_bits is None:
            measure_saved_values(gm, *inputs, values=candidates, config=config, progress=config.progress)
        if checkpointing:
            values, _, _ = saved_values(gm)
            largest = max((values[name] for name in candidates), key=lambda v: v.exact_bytes, default=None)
            largest = largest.root if largest else None
            if region_blocks is not None:
                blocks, timings = region_blocks(values, largest)
            else:
                blocks = tuple(find_blocks(gm, values))
                timings = measure_memory_options(gm, list(blocks), largest, inputs, config) if blocks else None
    values_only = plan_memory(gm, memory_budget, config)
    if timings is None:
        return values_only
    # The packer timed alone misses what a compressing step pays around it: calibrate on the values-only plan's
    # measured step, then weigh blocks against values.
    with measurement_sandbox(gm):
        measured = measure_memory_step(gm, values_only, inputs, config)
        if region_blocks is not None:
            # timed on the regions alone (eager code is not in ``gm``, nor its copies): their extra seconds, stated
            # in the whole model's exact step
            regions_step = cached_step_seconds(gm, inputs, lambda: gm.forward(*inputs), config)
            measured = 1.0 + (measured - 1.0) * regions_step / timings.step_seconds
            values_only = dataclasses.replace(values_only, eager_copy_bits=None)
    memory_plan = plan_memory(gm, memory_budget, config, blocks, calibrated_timings(timings, values_only, measured))
    if region_blocks is not None:   # its checkpoints run on the model's modules, which ``gm`` cannot time
        return memory_plan
    if memory_plan.checkpointed or memory_plan.values != values_only.values:
        with measurement_sandbox(gm):
            measured = measure_memory_step(gm, memory_plan, inputs, config)
    return dataclasses.replace(memory_plan, measured_time=measured)


def plan_saved_activations(gm: torch.fx.GraphModule, inputs: tuple, plan: Plan, state: ModelState,
                           config: ApproxConfig, checkpoint_blocks: bool = False, region_blocks=None) -> Plan:
    """Plan and mark the saved activations of ``gm`` (``plan``'s sampled ops already rewritten); records the
    resolved memory config and the saving options in ``state``; returns ``plan`` with its memory plan. With
    ``checkpoint_blocks`` (a traced model whose training forward can run a checkpointed copy of its graph) and
    ``config.activation_checkpoint``, the plan may checkpoint blocks too; a region-captured model passes
    ``region_blocks`` (see :func:`choose_memory_plan`) for its blocks."""
    memory_budget = state.memory_budget
    compact_max_pools(gm)
    recompute_attention(gm)
    # Sampled layers save gathered copies and max pools byte offsets now: measure the rewritten graph.
    with measurement_sandbox(gm), as_in_compressed_training():
        measure_saved_bytes(gm, *inputs, progress=config.progress)
        memory_config = state.memory_config = resolve_recompute(gm, memory_budget, config)
    memory_plan = choose_memory_plan(gm, inputs, memory_budget, memory_config, checkpoint_blocks, region_blocks)
    rewrite_saved_activations(gm, memory_plan)
    state.saving = SavingOptions(config.activation_group_size, config.activation_rounding,
                                    config.activation_compile)
    return dataclasses.replace(plan, memory=memory_plan)
