"""The saved-activations stage of planning, on a (rewritten) planning graph: the passes that choose what each
saved value keeps, run in the order they need. Shared by a traced model and a region-captured one."""

from __future__ import annotations

import dataclasses

import torch.fx

from fxapprox.analysis import measurement_sandbox
from fxapprox.config import ApproxConfig
from fxapprox.ops.attention import as_in_compressed_training
from fxapprox.passes.attention_recompute import recompute_attention
from fxapprox.passes.compact_pooling import compact_max_pools
from fxapprox.passes.measure_saved import measure_saved_values
from fxapprox.passes.memory_policy import memory_candidates, plan_memory, resolve_recompute
from fxapprox.passes.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.saved_bytes import measure_saved_bytes
from fxapprox.model_state import ModelState
from fxapprox.plan import Plan
from fxapprox.saved_activations import SavingOptions

__all__ = ["memory_planned", "plan_saved_activations"]


def memory_planned(memory_budget: float | None, config: ApproxConfig) -> bool:
    """Whether a memory plan is asked for."""
    return config.activation_bits is not None or (memory_budget is not None and memory_budget < 1.0)


def plan_saved_activations(gm: torch.fx.GraphModule, inputs: tuple, plan: Plan, state: ModelState,
                           config: ApproxConfig) -> Plan:
    """Plan and mark the saved activations of ``gm`` (``plan``'s sampled ops already rewritten); records the
    resolved memory config and the saving options in ``state``; returns ``plan`` with its memory plan."""
    memory_budget = state.memory_budget
    compact_max_pools(gm)
    recompute_attention(gm)
    # Sampled layers save gathered copies and max pools byte offsets now: measure the rewritten graph.
    with measurement_sandbox(gm), as_in_compressed_training():
        measure_saved_bytes(gm, *inputs, progress=config.progress)
        memory_config = state.memory_config = resolve_recompute(gm, memory_budget, config)
        if config.activation_policy == "measured" and config.activation_bits is None:
            measure_saved_values(gm, *inputs, values=memory_candidates(gm, memory_config), config=memory_config,
                                 progress=config.progress)
    memory_plan = plan_memory(gm, memory_budget, memory_config)
    rewrite_saved_activations(gm, memory_plan)
    state.saving = SavingOptions(config.activation_group_size, config.activation_rounding,
                                    config.activation_compile)
    return dataclasses.replace(plan, memory=memory_plan)
