"""Pass 6d — memory policy: turn ``memory_budget`` into bits for every saved graph value.

``memory_budget`` is the fraction of the exact model's saved-activation bytes
(every distinct tensor autograd keeps for backward, parameters left out) the
approximated model may keep. The unit the policy decides on is a *graph value*
— one tensor, however many nodes save it and however many views or in-place
ops (``relu_``) alias it — so a tensor is never kept both exact and compressed.

1. Values that cannot be compressed stay as they are, with the reason: not
   floating point, or smaller than ``activation_min_bytes``. Temporaries that are
   no graph value (batch statistics) stay; boolean ones (dropout masks) are
   bit-packed losslessly.
2. A value every saver of which only asks ``value > 0`` (a ReLU saving its own
   result, nothing else) becomes a 1-bit mask: lossless, so it goes first.
   The output of a LayerNorm, GELU or another op of
   :data:`~fxapprox.runtime.saved_activations.RECOMPUTABLE_FUNCTIONS` whose input is saved
   anyway (a LayerNorm and a GELU save their input themselves) is *recomputed*: backward
   re-runs the op on the input's saved copy, so it keeps no bytes of its own and shares
   its input's width (``activation_recompute``; the pair is measured together). When the
   budget cannot be met otherwise with every value at 8 bits or more
   (:func:`resolve_recompute`), plain Linear outputs are rebuilt too, through chains of
   rebuilt values (a feed-forward block's LayerNorm → Linear → GELU from the residual
   stream's copy).
3. Then the bits of the others. With ``activation_policy="measured"`` (default)
   each value's cost at 8, 4 and 2 bits has been measured on the example batch
   (``passes/memory/measure_saved.py``: its savers' gradient errors, as GACT adapts bits
   to measured sensitivity), and the widths are chosen with the least predicted
   model-gradient error that fits the budget (the same least-error allocation as
   the compute policy, per byte saved). With ``"width"`` the policy lowers the
   value with the most bits left (largest first) by one step, exact → 8 → 4 → 2,
   until the total fits: even widths, blind to what each value's error costs.
   Either way the inputs attention saves (q, k, v of ``scaled_dot_product_attention``)
   keep at least 8 bits: its backward exponentiates their product
   (``fxapprox.passes.memory.saved_values.EXPONENTIATING_SAVERS``).
4. If every value at its lowest width still does not fit, the plan says what it reached.

``ApproxConfig(activation_bits=b)`` instead stores every eligible value at ``b``
bits (the budget is then only reported against), like the compute policy's
``policy="uniform"``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.passes.memory.blocks import Block, MemoryTimings
from fxapprox.passes.memory.memory_widths import (RECOMPUTE_BITS, Widths, chain_root, eager_saved_totals, eligibility,
                                                  initial_widths, measured_widths, rebuilt_widths, recomputed,
                                                  sign_exact, uniform_widths, widest_first)
from fxapprox.passes.memory.saved_values import dtype_bits, mib, saved_values
from fxapprox.pipeline.records import BIT_ERRORS_KEY
from fxapprox.runtime.saved_tensors import EAGER_COPY_BITS
from fxapprox.plan import BlockDecision, MemoryPlan, SavedValueDecision


def memory_candidates(gm: torch.fx.GraphModule, config: ApproxConfig) -> dict:
    """The values whose bits the measured memory policy chooses:
    ``{name: (members, savers, sign_exact, rebuilt)}`` with ``rebuilt`` the values recomputed from it,
    directly or through others, ``[(name, members, savers, source)]`` in graph order, measured with it."""
    values, _, _ = saved_values(gm)
    rebuilt = recomputed(gm, values, config)
    dependents: dict[str, list] = {}
    for name, source in rebuilt.items():
        dependents.setdefault(chain_root(rebuilt, name), []).append(
            (name, {m.name for m in values[name].members}, sorted(values[name].savers), source))
    return {name: ({m.name for m in value.members}, sorted(value.savers), sign_exact(gm, value),
                   dependents.get(name, []))
            for name, value in values.items() if eligibility(value, config) is None and name not in rebuilt}


def resolve_recompute(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig) -> ApproxConfig:
    """``config`` with ``activation_recompute="auto"`` decided: Linear outputs are rebuilt (``"linear"``) only
    when the budget cannot be met otherwise with every value at 8 bits or more.

    On the char transformer at ``memory_budget=0.125`` the plan without them keeps 4-bit copies, whose
    model-gradient error grows as the model trains (``benchmarks/bench_planner.py``, "attention"); rebuilding
    the feed-forward block's first Linear and GELU from the residual stream's copy lets every value keep
    8 bits, for one more GEMM in backward.
    """
    if config.activation_recompute != "auto":
        return config
    cheap = dataclasses.replace(config, activation_recompute=True)
    if config.activation_bits is not None or memory_budget is None or memory_budget >= 1.0:
        return cheap
    values, internal, internal_bool = saved_values(gm)
    rebuilt = recomputed(gm, values, cheap)
    group = config.activation_group_size
    total = internal - internal_bool + (internal_bool + 7) // 8
    for name, value in values.items():
        blocker = eligibility(value, config)
        if name in rebuilt:
            continue
        if blocker == "sign":
            total += value.bytes_at(1, group)
        elif blocker is not None:
            total += value.exact_bytes
        else:
            total += value.bytes_at(max(8, value.min_bits), group)
    # eager code's saves may be kept as copies (8 bits) first
    eager_exact, eager_copied = eager_saved_totals(gm)
    total -= eager_exact - eager_copied
    exact_total = sum(v.exact_bytes for v in values.values()) + internal
    fits = total <= memory_budget * exact_total
    return cheap if fits else dataclasses.replace(config, activation_recompute="linear")


def plan_memory(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig,
                blocks: tuple[Block, ...] = (), timings: MemoryTimings | None = None) -> MemoryPlan | None:
    """Decide the bits of every saved value, and which ``blocks`` to checkpoint; ``None`` when activations are not
    to be compressed.

    With ``blocks`` and their ``timings`` (``fxapprox.passes.memory.measure_blocks``) the policy weighs checkpointing
    against compressing: blocks are taken in order of bytes freed per second of recompute, and for each prefix
    (none, the first, the first two, …) the widths of what is still saved are chosen for the budget as without
    blocks. The plan predicted to run the fastest step (re-running its blocks, packing and unpacking its copies)
    wins; among plans within 2% of the exact step of it, the one with the least predicted gradient error
    (recomputation is exact).

    Example::

        >>> plan = plan_memory(gm, 0.125, ApproxConfig())   # after measure_saved_bytes
        >>> plan.achieved <= 0.125
        True
    """
    uniform_bits = config.activation_bits
    if uniform_bits is None and (memory_budget is None or memory_budget >= 1.0):
        return None
    if uniform_bits is not None or timings is None or not blocks:
        widths, measured = _widths_for(gm, memory_budget, config, ())
        return _memory_plan(gm, widths, memory_budget, uniform_bits, measured)
    order = sorted(blocks, key=lambda b: -(b.interior_bytes + b.eager_bytes) / max(timings.recompute_seconds[b.name],
                                                                                     1e-9))
    options = []
    for count in range(len(order) + 1):
        chosen = tuple(order[:count])
        for compressed_recompute in (False, True) if count else (False,):
            widths, measured = _widths_for(gm, memory_budget, config, chosen, compressed_recompute)
            met = widths.planned_total() <= memory_budget * widths.exact_total * (1 + 1e-9)
            options.append((chosen, widths, measured, met, _extra_seconds(widths, chosen, timings)))
    met_options = [o for o in options if o[3]]
    if met_options:
        fastest = min(o[4] for o in met_options)
        near = [o for o in met_options if o[4] <= fastest + 0.02 * timings.step_seconds]
        chosen, widths, measured, _, seconds = min(near, key=lambda o: (_squared_error(o[1]), o[4]))
    else:
        chosen, widths, measured, _, seconds = min(options, key=lambda o: (o[1].planned_total(), o[4]))
    return _memory_plan(gm, widths, memory_budget, uniform_bits, measured,
                        blocks=_block_decisions(gm, widths, blocks, chosen, timings),
                        predicted_time=1.0 + seconds / timings.step_seconds)


def _squared_error(widths: Widths) -> float:
    return sum(widths.errors.values()) + widths.recompute_errors


def _widths_for(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig,
                checkpointed: tuple[Block, ...], compressed_recompute: bool = False) -> tuple[Widths, bool]:
    """The widths the configured policy chooses with ``checkpointed`` blocks, and whether they were measured.

    Eager code's saves (a region-captured model) are kept as :data:`EAGER_COPY_BITS`-bit copies when the budget
    needs them: with them as they are, it is not met or some value goes below that width."""
    widths, measured = _widths_at(gm, memory_budget, config, checkpointed, compressed_recompute, False)
    if widths.eager_copy_bytes < widths.eager_bytes and _needs_eager_copies(widths, memory_budget, config):
        widths, measured = _widths_at(gm, memory_budget, config, checkpointed, compressed_recompute, True)
    return widths, measured


def _needs_eager_copies(widths: Widths, memory_budget: float | None, config: ApproxConfig) -> bool:
    if config.activation_bits is not None:
        return config.activation_bits <= EAGER_COPY_BITS
    if widths.planned_total() > memory_budget * widths.exact_total * (1 + 1e-9):
        return True
    return any(widths.compressed(n) and widths.bits[n] < EAGER_COPY_BITS for n in widths.candidates)


def _widths_at(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig,
               checkpointed: tuple[Block, ...], compressed_recompute: bool, copy_eager: bool) -> tuple[Widths, bool]:
    uniform_bits = config.activation_bits
    widths = initial_widths(gm, config, checkpointed, compressed_recompute, copy_eager)
    measured = config.activation_policy == "measured" and uniform_bits is None and all(
        BIT_ERRORS_KEY in widths.values[n].root.meta for n in widths.candidates)
    if uniform_bits is not None:
        uniform_widths(widths, uniform_bits)
    elif measured:
        measured_widths(widths, memory_budget)
    else:
        widest_first(widths, memory_budget)
    rebuilt_widths(gm, widths, config)
    return widths, measured


def _value_seconds(compressed: list[tuple[int, int]], rebuilt_bytes: int, timings: MemoryTimings) -> float:
    """Uncalibrated seconds of ``compressed`` copies ``(bits, exact bytes)`` packed and unpacked and of
    ``rebuilt_bytes`` rebuilt in backward (one pass over them, costed like an 8-bit copy)."""
    pack = timings.pack_seconds_per_byte
    return sum(pack.get(bits, 0.0) * size for bits, size in compressed if bits > 1) + pack.get(8, 0.0) * rebuilt_bytes


def _extra_seconds(widths: Widths, checkpointed: tuple[Block, ...], timings: MemoryTimings) -> float:
    """Predicted seconds a step spends beyond the exact one: blocks re-run, values packed, unpacked and rebuilt."""
    compressed = [(widths.bits[n], widths.values[n].exact_bytes) for n in widths.bits if widths.compressed(n)]
    compressed += [(bits, widths.values[n].exact_bytes) for block in widths.recompute_bits.values()
                   for n, bits in block.items() if bits < dtype_bits(widths.values[n].dtype)]
    if widths.copy_eager:
        compressed.append((EAGER_COPY_BITS, widths.eager_bytes))
    rebuilt = sum(widths.values[n].exact_bytes for n in widths.rebuilt)
    return (sum(timings.recompute_seconds[b.name] for b in checkpointed)
            + timings.value_scale * _value_seconds(compressed, rebuilt, timings))


def calibrated_timings(timings: MemoryTimings, memory_plan: MemoryPlan, measured_time: float) -> MemoryTimings:
    """``timings`` with ``value_scale`` set so that ``memory_plan`` (no block checkpointed) is predicted to take
    ``measured_time`` exact steps (the scale stays 1 when it compresses nothing or measured no slower)."""
    compressed = [(v.bits, v.exact_bytes) for v in memory_plan.values if v.compressed]
    if memory_plan.eager_copy_bits is not None:
        compressed.append((memory_plan.eager_copy_bits, memory_plan.eager_bytes))
    rebuilt = sum(v.exact_bytes for v in memory_plan.values if v.recomputed_from is not None)
    modelled = _value_seconds(compressed, rebuilt, timings)
    extra = (measured_time - 1.0) * timings.step_seconds
    if modelled <= 0 or extra <= 0:
        return timings
    return dataclasses.replace(timings, value_scale=extra / modelled)


def _block_decisions(gm: torch.fx.GraphModule, widths: Widths, blocks: tuple[Block, ...],
                     chosen: tuple[Block, ...], timings: MemoryTimings) -> tuple[BlockDecision, ...]:
    step = timings.step_seconds
    decisions = []
    for block in blocks:
        seconds = timings.recompute_seconds[block.name]
        checkpointed = block in chosen
        bits = widths.recompute_bits.get(block.name)
        recompute_values = []
        if checkpointed:
            reason = (f"checkpointed: re-run in backward ({seconds * 1e3:.1f} ms, {seconds / step:.1%} of the exact "
                      f"step) frees {mib(block.interior_bytes + block.eager_bytes)}"
                      + (f", {mib(block.eager_bytes)} of it saved by its eager code" if block.eager_bytes else ""))
            if bits:
                held = sum(widths.values[n].bytes_at(b, widths.group) for n, b in bits.items())
                reason += f"; the re-run keeps its values as {RECOMPUTE_BITS}-bit copies ({mib(held)})"
                for name, b in bits.items():
                    value = widths.values[name]
                    if b < dtype_bits(value.dtype):
                        recompute_values.append([value.members[-1].name, b, 1 < b < 16 and sign_exact(gm, value)])
        else:
            reason = "kept: the budget is met faster (or with less error) without re-running it"
        decisions.append(BlockDecision(
            name=block.name, nodes=list(block.nodes), inputs=list(block.inputs), attributes=list(block.attributes),
            outputs=list(block.outputs), interior_bytes=int(block.interior_bytes), input_bytes=int(block.input_bytes),
            recompute_seconds=float(seconds), checkpointed=checkpointed, reason=reason,
            recompute_bits=RECOMPUTE_BITS if checkpointed and bits else None, recompute_values=recompute_values,
            inputs_copied=checkpointed and widths.copies_inputs(block)))
    return tuple(decisions)


def _memory_plan(gm: torch.fx.GraphModule, widths: Widths, memory_budget: float | None, uniform_bits: int | None,
                 measured: bool, blocks: tuple[BlockDecision, ...] = (), predicted_time: float | None = None
                 ) -> MemoryPlan:
    """The :class:`MemoryPlan` of the chosen widths, with its note."""
    values, bits, rebuilt = widths.values, widths.bits, widths.rebuilt
    exact_total, planned = widths.exact_total, widths.planned_total()
    if memory_budget is None:
        met, budget_text = True, f"activation_bits={uniform_bits}"
    else:
        met = planned <= memory_budget * exact_total * (1 + 1e-9)
        budget_text = f"memory budget {memory_budget:g}"
    why_not = ""
    if not met:
        kept = [v.exact_bytes for n, v in values.items()
                if bits[n] >= dtype_bits(v.dtype) and n not in widths.candidates and n not in rebuilt
                and n not in widths.freed]
        why_not = (f", NOT met: every eligible value is at its lowest width; {len(kept)} values ({mib(sum(kept))}) "
                   f"and {mib(widths.planned_internal)} of temporaries stay as they are")
    predicted = math.sqrt(_squared_error(widths)) if measured else None
    error_text = "" if predicted is None else f"; predicted model-gradient error {predicted:.3f}"
    eager = widths.eager_bytes
    eager_planned = widths.eager_copy_bytes if widths.copy_eager else eager
    if not eager:
        eager_text = ""
    elif widths.copy_eager:
        eager_text = (f"; {mib(eager)} saved by eager code, kept as {EAGER_COPY_BITS}-bit copies where eligible "
                      f"({mib(eager_planned)})")
    else:
        eager_text = f"; {mib(eager)} saved by eager code, kept exact"
    checkpointed = sum(b.checkpointed for b in blocks)
    recompute_bytes = widths.recompute_peak()[1] if planned > widths.kept_total() else 0
    blocks_text = (f"; {checkpointed} of {len(blocks)} blocks checkpointed" if blocks else "") + (
        f" (at the peak, a re-run holds {mib(recompute_bytes)})" if recompute_bytes else "") + (
        f"; predicted step {predicted_time:.2f}x exact's" if predicted_time is not None else "")
    note = (f"saved activations: exact {mib(exact_total)}, planned {mib(planned)} "
            f"({planned / exact_total if exact_total else 1.0:.3f} of exact; {budget_text}{why_not}{error_text}"
            f"{blocks_text}{eager_text})")
    decisions = []
    for name, value in values.items():
        b = bits[name]
        source = rebuilt.get(name)
        compressed = widths.compressed(name)
        decisions.append(SavedValueDecision(
            node=name, shape=value.shape, dtype=str(value.dtype).replace("torch.", ""),
            exact_bytes=value.exact_bytes, planned_bytes=widths.planned_bytes(name), bits=b,
            reason=widths.reasons[name], savers=sorted(value.savers), aliases=[m.name for m in value.members[1:]],
            sign_exact=compressed and 1 < b < 16 and sign_exact(gm, value), compressed=compressed,
            predicted_error=(math.sqrt(widths.errors.get(name, 0.0))
                             if measured and source is None and name not in widths.freed else None),
            recomputed_from=source, checkpointed_in=widths.freed.get(name)))
    return MemoryPlan(memory_budget=memory_budget, total_exact_bytes=int(exact_total),
                      total_planned_bytes=int(planned), internal_bytes=int(widths.internal), budget_met=met,
                      note=note, values=tuple(decisions), predicted_error=predicted, eager_bytes=int(eager),
                      eager_planned_bytes=int(eager_planned),
                      eager_copy_bits=EAGER_COPY_BITS if widths.copy_eager else None,
                      blocks=blocks, predicted_time=predicted_time, recompute_bytes=int(recompute_bytes))
