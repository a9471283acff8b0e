"""The row family's plan as :func:`fxapprox.approximate` makes it, for a traced model and a region-captured one
alike: whether the forward must stay exact (``passes/measurement/measure_rows.forward_disruption``), the blocks
(``passes/analysis/row_blocks.py``), probed on the example batch (``passes/measurement/measure_rows.py``), their
ratios for the budget (``passes/policy/row_policy.py``). The ratios are calibrated on the first training step, whose
loss is the user's (``fxapprox.runtime.row_blocks``): a numeric budget takes the token ratio of least measured
variance, ``"auto"`` the ratios its variance bound allows (it trains that first step exactly).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.passes.measurement.candidates import planned_layers
from fxapprox.passes.measurement.measure_rows import forward_disruption, probe_row_blocks
from fxapprox.passes.policy.budget_policy import AUTO_BUDGET, assemble_plan, decisions_for
from fxapprox.passes.policy.row_policy import eligible_row_blocks, ratio_for_budget, row_choices, row_plan, with_ratios
from fxapprox.pipeline.memory_planning import memory_planned
from fxapprox.pipeline.records import train_flops
from fxapprox.plan import Plan
from fxapprox.runtime.model_state import ModelState

__all__ = ["forward_sampling_harmless", "make_row_plan", "row_note", "row_planned"]

def row_planned(state: ModelState, config: ApproxConfig) -> bool:
    """Whether the plan may be a row plan: row sampling on, the measured policy, something to save, no memory plan
    (a block is either replayed on its kept rows or checkpointed, not both, in this version)."""
    return (config.row_sampling and config.policy == "measured" and config.mode is None
            and (state.budget == AUTO_BUDGET or state.budget < 1.0)
            and not memory_planned(state.memory_budget, config))


def forward_sampling_harmless(call, state: ModelState, config: ApproxConfig) -> str | None:
    """Why a numeric budget should go to the families that sample forwards too (``None``: keep the forward exact,
    plan rows): sampling the forward at the budget's keep-ratio moves the model's predictions on the example batch
    by at most ``max_forward_kl`` (``passes/measurement/measure_rows.forward_disruption``). ``"auto"`` always plans
    rows (its variance bound decides how much)."""
    if state.budget == AUTO_BUDGET or config.max_forward_kl is None:
        return None
    kl = forward_disruption(call, state.budget, config.min_channels)
    if kl is None or kl > config.max_forward_kl:
        return None
    return (f"sampled forwards at keep {state.budget:g} move the model's predictions by {kl:.3g} nats per output "
            f"(<= max_forward_kl {config.max_forward_kl:g}), so the forward may be sampled too")


def make_row_plan(gm: torch.fx.GraphModule, state: ModelState, config: ApproxConfig, runs: dict,
                  unrunnable: dict) -> tuple[Plan | None, str | None]:
    """``(plan, None)``: the row plan of ``gm`` (analysed, candidates enumerated, its row blocks found: ``runs`` /
    ``unrunnable`` say how to run each on the example batch for its probe) before calibration; or ``(None, why)``
    when the row family does not make the plan (no block qualifies, or a numeric budget below what its blocks
    reach)."""
    probe_row_blocks(gm, runs, unrunnable)
    blocks = eligible_row_blocks(gm)
    if not blocks:
        return None, "no block qualifies for row sampling"
    total = sum(train_flops(n) for n in gm.graph.nodes)
    auto = state.budget == AUTO_BUDGET
    breakeven = _token_breakeven(gm, blocks, config) if min(config.token_ratios) < 1.0 else 1.0
    tokens = [t for t in config.token_ratios if t >= 1.0 or t <= breakeven] or [1.0]
    if auto:
        ratio, token = 1.0, 1.0
        options = {}
    else:
        options = {}
        for token in tokens:
            found = ratio_for_budget(blocks, total, state.budget, token)
            if found is not None:
                options[token] = found
        if not options:
            lowest = (total - sum(b.exact_flops - b.flops(0.05, min(config.token_ratios)) for b in blocks)) / total
            return None, (f"the row-sampled blocks reach {lowest:.2f} of exact training FLOPs at the fewest rows, "
                          f"above the budget {state.budget:g}")
        token = max(options)
        ratio = options[token]
    choices = row_choices(gm, blocks, ratio, token)
    decisions = decisions_for(gm, planned_layers(gm), choices, config, measured=False)
    row_breakeven = min(b.breakeven(1.0) for b in blocks)
    if auto:   # "auto" samples only where it pays in time; a numeric budget is an instruction on FLOPs
        row_breakeven = min(row_breakeven, _row_time_breakeven(blocks, runs, config))
    rows = dataclasses.replace(row_plan(gm, ratio, token, config.variance_tau if auto else None, note="",
                                        options=options), token_breakeven=breakeven, row_breakeven=row_breakeven)
    plan = assemble_plan(state.budget, state.method, total, decisions, config, "", None, True)
    plan = with_ratios(dataclasses.replace(plan, rows=rows), gm, ratio, token)
    return dataclasses.replace(plan, note=row_note(plan)), None


def _row_time_breakeven(blocks, runs: dict, config: ApproxConfig) -> float:
    """:func:`~fxapprox.passes.measurement.measure_rows.row_time_breakeven` of the sampled block of most FLOPs (the
    blocks of a transformer are alike: one is timed)."""
    from fxapprox.passes.measurement.measure_rows import block_parameters, row_time_breakeven
    from fxapprox.pipeline.timing_cache import TimingCache

    timed = [b for b in blocks if b.name in runs]
    if not timed:
        return 1.0
    run = runs[max(timed, key=lambda b: b.exact_flops).name]
    parameter = next(iter(block_parameters(run)), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return row_time_breakeven(run, TimingCache.for_config(config.timing_cache, device))


def _token_breakeven(gm: torch.fx.GraphModule, blocks, config: ApproxConfig) -> float:
    """:func:`~fxapprox.passes.measurement.measure_rows.token_breakeven` at the blocks' largest linear layer (by
    weight-gradient FLOPs) on the example batch's shapes."""
    from fxapprox.op_kinds.registry import handler_for
    from fxapprox.passes.measurement.measure_rows import token_breakeven
    from fxapprox.pipeline.records import kind_of, tensor_of
    from fxapprox.pipeline.timing_cache import TimingCache

    by_name = {n.name: n for n in gm.graph.nodes}
    layers = [by_name[name] for block in blocks for name in block.layers]
    layer = max(layers, key=lambda n: handler_for(n).weight_grad_flops(n))
    kind, shape = kind_of(layer), tensor_of(layer).shape
    rows = 1
    for size in shape[:-1]:
        rows *= size
    parameter = next((p for p in gm.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = parameter.dtype if parameter is not None else torch.float32
    cache = TimingCache.for_config(config.timing_cache, device)
    return token_breakeven(rows, kind.in_channels, kind.out_channels, dtype, device, cache)


def row_note(plan: Plan) -> str:
    """The plan's note: what it samples, the FLOPs, and what the last variance check measured."""
    rows = plan.rows
    sampled = rows.sampled
    ratio = min((b.ratio for b in sampled), default=1.0)
    asked = "budget auto" if plan.budget == AUTO_BUDGET else f"budget {plan.budget:g} asked"
    text = (f"{asked}: {plan.achieved:.3f} of exact training FLOPs planned; rows: {len(sampled)} block(s) run their "
            f"backward on {ratio:.0%} of the samples, weight gradients on {rows.token_ratio:.0%} of their tokens; "
            f"forward exact")
    if rows.variance_ratio is not None:
        text += (f"; step {rows.checked_step}'s check: sampling variance {rows.variance_ratio:.3g} × the minibatch's "
                 f"at rows {rows.checked_ratio:.2f} / tokens {rows.checked_token_ratio:.2f} (noise scale B_noise/B "
                 f"{rows.noise_scale:.3g})")
        if rows.tau is not None:
            text += f"; ratios set for tau {rows.tau:g} per part"
            if not rows.saved_flops:
                text += (f": nothing sampled — within it, sampling saves less than it costs here (rows pay below "
                         f"{rows.row_breakeven or 1.0:.2f} of the samples, tokens below "
                         f"{rows.token_breakeven or 1.0:.2f}; the minibatch's own noise leaves little room)")
    return text
