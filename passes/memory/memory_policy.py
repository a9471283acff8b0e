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
from torch import nn

from fxapprox.config import ApproxConfig
from fxapprox.passes.memory.blocks import Block, MemoryTimings, node_bytes
from fxapprox.passes.memory.measure_saved import SAVED_BITS
from fxapprox.passes.memory.saved_values import SavedValue, dtype_bits, is_relu, mib, saved_values
from fxapprox.passes.policy._allocation import least_error_allocation
from fxapprox.pipeline.records import BIT_ERRORS_KEY, EAGER_SAVED_KEY, saved_of
from fxapprox.plan import BlockDecision, MemoryPlan, SavedValueDecision
from fxapprox.runtime.recompute import RECOMPUTABLE_FUNCTIONS, RECOMPUTABLE_METHODS, RECOMPUTABLE_MODULES

_RECIPE_NAMES = {function: name for name, function in RECOMPUTABLE_FUNCTIONS.items()}


@dataclasses.dataclass(frozen=True)
class BitsOption:
    """A saved value at ``bits``: the bytes it saves and the squared gradient error it adds (measured)."""

    bits: int
    saving: int
    contribution: float



def recipe_of(gm: torch.fx.GraphModule, node: torch.fx.Node, linear: bool = False
              ) -> tuple[str, torch.fx.Node] | None:
    """``(recipe, source)`` when the runtime can rebuild ``node``'s output in backward by re-running it on its one
    activation input ``source`` (other tensor inputs must be parameters): the recipe is ``"module"``, a name in
    ``RECOMPUTABLE_FUNCTIONS`` or ``"method:<name>"``. With ``linear``, plain ``nn.Linear`` modules and
    ``F.linear`` calls qualify too (their rebuild costs a GEMM)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        plain_linear = linear and type(module) is nn.Linear
        if not (plain_linear or isinstance(module, RECOMPUTABLE_MODULES)) or getattr(module, "inplace", False):
            return None
        recipe = "module"
    elif node.op == "call_function" and linear and node.target is torch.nn.functional.linear:
        recipe = "linear"
    elif node.op == "call_function" and node.target in _RECIPE_NAMES and not node.kwargs.get("inplace"):
        recipe = _RECIPE_NAMES[node.target]
    elif node.op == "call_method" and node.target in RECOMPUTABLE_METHODS:
        recipe = f"method:{node.target}"
    else:
        return None
    inputs = [a for a in node.all_input_nodes if a.op != "get_attr"]
    return (recipe, inputs[0]) if len(inputs) == 1 else None


def _recomputed(gm: torch.fx.GraphModule, values: dict[str, SavedValue], config: ApproxConfig) -> dict[str, str]:
    """``{value: source value}`` for the values backward rebuilds from their source, in graph order.

    The source is either stored (saved by a node that runs before the value's savers, so its copy exists
    when the value is marked) or itself rebuilt (a chain: ``activation_recompute="linear"`` rebuilds a
    feed-forward block's LayerNorm, first Linear and GELU from the residual stream's copy). The value must
    be a plain tensor of its own: not written in place, no sampled op's gathered copy, not a lossless ReLU
    mask.
    """
    if not config.activation_recompute:
        return {}
    linear = config.activation_recompute == "linear"   # "auto" is decided by resolve_recompute first
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    by_name = {node.name: node for node in gm.graph.nodes}
    root_of = {m.name: name for name, value in values.items() for m in value.members}
    rebuilt: dict[str, str] = {}
    for name, value in values.items():
        found = recipe_of(gm, value.root, linear)
        if found is None or value.derived or _eligibility(value, config) is not None:
            continue
        if any(saved_of(m).inplace for m in value.members[1:]):
            continue
        # Savers must read the value itself, not a view of it: the measurement rebuilds the whole value.
        if not all(saver == name or value.root in by_name[saver].all_input_nodes for saver in value.savers):
            continue
        source = root_of.get(found[1].name)
        if source is None or source == name:
            continue
        if source not in rebuilt:
            if not values[source].direct or _eligibility(values[source], config) == "sign":
                continue
            if min(order[s] for s in values[source].savers) > order[value.members[-1].name]:
                continue
        rebuilt[name] = source
    return rebuilt


def chain_root(rebuilt: dict[str, str], name: str) -> str:
    """The stored value a rebuilt value is rebuilt from, through any rebuilt ones between."""
    while name in rebuilt:
        name = rebuilt[name]
    return name


#: the fewest bits a checkpointed block's input keeps: its copy is what the whole block is recomputed from
CHECKPOINT_INPUT_BITS = 8
#: the bits a checkpointed block's values keep while its backward runs, when its re-run compresses them
RECOMPUTE_BITS = 8


def _floor_note(value: SavedValue, bits: int) -> str:
    if not value.min_bits or bits > value.min_bits:
        return ""
    if (value.floor_saver or "").startswith("checkpointed block"):
        return f"; no fewer than {value.min_bits} bits: {value.floor_saver} is recomputed from it"
    return f"; no fewer than {value.min_bits} bits: {value.floor_saver} {value.floor_reason}"


def _sign_exact(gm: torch.fx.GraphModule, value: SavedValue) -> bool:
    """The tensor's last writer is a ReLU (views do not write; in-place ops do)."""
    writers = [value.root] + [m for m in value.members[1:] if saved_of(m).inplace]
    return is_relu(gm, writers[-1])


def _eligibility(value: SavedValue, config: ApproxConfig) -> str | None:
    """Why a value keeps its bits (or ``"sign"``: a lossless 1-bit mask), ``None`` when its bits are chosen."""
    if value.dtype is None or not value.dtype.is_floating_point:
        return "kept: not a floating-point tensor"
    if value.exact_bytes < config.activation_min_bytes:
        return f"kept: small ({value.exact_bytes} B < activation_min_bytes)"
    if value.sign_only and config.activation_bits != 32:
        return "sign"
    return None


def memory_candidates(gm: torch.fx.GraphModule, config: ApproxConfig) -> dict:
    """The values whose bits the measured memory policy chooses:
    ``{name: (members, savers, sign_exact, rebuilt)}`` with ``rebuilt`` the values recomputed from it,
    directly or through others, ``[(name, members, savers, source)]`` in graph order, measured with it."""
    values, _, _ = saved_values(gm)
    rebuilt = _recomputed(gm, values, config)
    dependents: dict[str, list] = {}
    for name, source in rebuilt.items():
        dependents.setdefault(chain_root(rebuilt, name), []).append(
            (name, {m.name for m in values[name].members}, sorted(values[name].savers), source))
    return {name: ({m.name for m in value.members}, sorted(value.savers), _sign_exact(gm, value),
                   dependents.get(name, []))
            for name, value in values.items() if _eligibility(value, config) is None and name not in rebuilt}


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
    rebuilt = _recomputed(gm, values, cheap)
    group = config.activation_group_size
    total = internal - internal_bool + (internal_bool + 7) // 8
    for name, value in values.items():
        blocker = _eligibility(value, config)
        if name in rebuilt:
            continue
        if blocker == "sign":
            total += value.bytes_at(1, group)
        elif blocker is not None:
            total += value.exact_bytes
        else:
            total += value.bytes_at(max(8, value.min_bits), group)
    exact_total = sum(v.exact_bytes for v in values.values()) + internal
    fits = total <= memory_budget * exact_total
    return cheap if fits else dataclasses.replace(config, activation_recompute="linear")


@dataclasses.dataclass
class _Widths:
    """The memory policy's working state: every saved value's width so far, and why."""

    values: dict[str, SavedValue]
    rebuilt: dict[str, str]              # rebuilt value → the value it is rebuilt from
    group: int                           # quantisation group size
    internal: int                        # bytes of temporaries that are no graph value
    planned_internal: int                # the same, boolean ones as bit masks
    bits: dict[str, int] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    candidates: list[str] = dataclasses.field(default_factory=list)   # values whose width the policy chooses
    routed: set[str] = dataclasses.field(default_factory=set)         # through the hooks at their full width
    errors: dict[str, float] = dataclasses.field(default_factory=dict)  # predicted squared gradient errors
    freed: dict[str, str] = dataclasses.field(default_factory=dict)   # value → the checkpointed block it lives in
    held: int = 0     # bytes of checkpointed blocks' inputs no graph value saves otherwise (kept by the checkpoint)
    # each checkpointed block: (its last node's position, bytes its re-run holds while its backward runs, the block)
    recomputing: list[tuple] = dataclasses.field(default_factory=list)
    positions: dict[str, int] = dataclasses.field(default_factory=dict)   # value → its root's position
    root_of: dict[str, str] = dataclasses.field(default_factory=dict)     # node (any alias) → its value
    recompute_bits: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # block → {value: bits}
    recompute_errors: float = 0.0        # predicted squared gradient error of compressed re-runs

    @property
    def exact_total(self) -> int:
        return sum(v.exact_bytes for v in self.values.values()) + self.internal

    def planned_bytes(self, name: str) -> int:
        if name in self.rebuilt or name in self.freed:
            return 0
        return self.values[name].bytes_at(self.bits[name], self.group)

    def kept_total(self) -> int:
        """What the step keeps from forward to backward."""
        return sum(self.planned_bytes(n) for n in self.bits) + self.planned_internal + self.held

    def recompute_peak(self) -> tuple[int, int]:
        """``(peak, re-run bytes)`` over the checkpointed blocks: while a block's backward runs, the values kept
        before it (those after it are freed by then) and what its re-run holds."""
        best = (0, 0)
        for position, held, block in self.recomputing:
            before = sum(self.planned_bytes(n) for n in self.bits if self.positions[n] <= position)
            if self.copies_inputs(block) or block.name in self.recompute_bits:
                held += block.input_bytes   # a reentrant re-run runs on exact copies of its inputs
            best = max(best, (before + held + self.planned_internal + self.held, held))
        return best

    def copies_inputs(self, block: Block) -> bool:
        """Whether the plan keeps one of ``block``'s inputs as a copy or rebuilds it (a reentrant checkpoint)."""
        roots = [self.root_of.get(i) for i in block.inputs]
        return any(r in self.rebuilt or (r in self.bits and self.compressed(r)) for r in roots if r is not None)

    def planned_total(self) -> int:
        """The most the step holds: everything kept, or a checkpointed block's re-run on top of what precedes it."""
        return max(self.kept_total(), self.recompute_peak()[0])

    def compressed(self, name: str) -> bool:
        return (name not in self.rebuilt and name not in self.freed
                and (self.bits[name] < dtype_bits(self.values[name].dtype) or name in self.routed))


def _without_blocks(values: dict[str, SavedValue], rebuilt: dict[str, str], freed: set[str],
                    block_nodes: set[str], exact_inputs: set[str]) -> dict[str, str]:
    """``rebuilt`` less every rebuild a checkpointed block breaks: of a value freed with its block, rooted inside
    one, kept exact as a block's input, or rebuilt through any of those (repeated until nothing changes)."""
    rebuilt = dict(rebuilt)
    broken = {name for name in rebuilt
              if name in freed or name in exact_inputs or values[name].root.name in block_nodes}
    while True:
        chain_broken = {name for name, source in rebuilt.items()
                        if name not in broken and (source in broken or source in freed or source in exact_inputs)}
        if not chain_broken:
            break
        broken |= chain_broken
    return {name: source for name, source in rebuilt.items() if name not in broken}


def _recompute_widths(values: dict[str, SavedValue], block: Block, config: ApproxConfig) -> dict[str, int]:
    """The bits a checkpointed block's values keep while its backward runs, when its re-run compresses them: 8
    (or a value's floor), a lossless mask for a ReLU result only the ReLU saves, as they are when ineligible."""
    widths = {}
    for name in block.interior:
        value = values[name]
        blocker = _eligibility(value, config)
        widths[name] = (1 if blocker == "sign" else dtype_bits(value.dtype) if blocker is not None
                        else max(RECOMPUTE_BITS, value.min_bits))
    return widths


def _initial_widths(gm: torch.fx.GraphModule, config: ApproxConfig, checkpointed: tuple[Block, ...] = (),
                    compressed_recompute: bool = False) -> _Widths:
    """Every value at its dtype's width, the rebuilt ones chosen, the ineligible ones with their reason; with
    ``checkpointed`` blocks, the values only they save freed, their inputs held by the checkpoint and what each
    re-run holds (with ``compressed_recompute``, as copies where its inputs let the re-run be reentrant)."""
    values, internal, internal_bool = saved_values(gm)
    freed = {name: block.name for block in checkpointed for name in block.interior}
    root_of = {m.name: name for name, value in values.items() for m in value.members}
    exact_inputs = {root_of[i]: block.name for block in checkpointed if not block.inputs_need_grad
                    for i in block.inputs if i in root_of}
    rebuilt = _recomputed(gm, values, config)
    if checkpointed:
        rebuilt = _without_blocks(values, rebuilt, set(freed), {n for b in checkpointed for n in b.nodes},
                                  set(exact_inputs))
    by_name = {node.name: node for node in gm.graph.nodes}
    held = {i for block in checkpointed for i in block.inputs if i not in root_of or root_of[i] in freed}
    block_inputs = {root_of[i]: block.name for block in checkpointed for i in block.inputs if i in root_of}
    for name, block_name in block_inputs.items():
        # The copy feeds the block's whole recomputation (a BatchNorm renormalises its error), not only its savers,
        # which is all its measured cost covers.
        if values[name].min_bits < CHECKPOINT_INPUT_BITS:
            values[name].min_bits, values[name].floor_saver = CHECKPOINT_INPUT_BITS, f"checkpointed block {block_name}"
    widths = _Widths(values, rebuilt, config.activation_group_size, internal,
                     internal - internal_bool + (internal_bool + 7) // 8, freed=freed,
                     held=sum(node_bytes(by_name[i]) for i in held))
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    widths.positions = {name: order[value.root.name] for name, value in values.items()}
    widths.root_of = root_of
    block_nodes = {n for block in checkpointed for n in block.nodes}
    for name in list(widths.candidates):
        value = values[name]
        if value.root.name not in block_nodes and any(m.name in block_nodes for m in value.members):
            # its last alias is made inside a checkpointed block, where no marker can stand
            widths.candidates.remove(name)
            widths.reasons[name] = "kept: an alias of it is made inside a checkpointed block"
    for block in checkpointed:
        if compressed_recompute and block.inputs_need_grad:
            widths.recompute_bits[block.name] = _recompute_widths(values, block, config)
            bits = widths.recompute_bits[block.name]
            held_bytes = sum(values[n].bytes_at(bits[n], widths.group) for n in block.interior)
            widths.recompute_errors += sum(
                values[n].root.meta[BIT_ERRORS_KEY][bits[n]]["contribution"] for n in block.interior
                if bits[n] in SAVED_BITS and BIT_ERRORS_KEY in values[n].root.meta)
        else:
            held_bytes = block.interior_bytes
        widths.recomputing.append((order[block.nodes[-1]], held_bytes, block))
    for name in widths.rebuilt:  # a rebuilt value's floor (attention reads it) binds the value it is rebuilt from
        root = values[chain_root(widths.rebuilt, name)]
        if values[name].min_bits > root.min_bits:
            root.min_bits, root.floor_saver = values[name].min_bits, values[name].floor_saver
            root.floor_reason = values[name].floor_reason
    for name, value in values.items():
        widths.bits[name] = dtype_bits(value.dtype)
        blocker = _eligibility(value, config)
        if name in widths.rebuilt:
            continue
        if name in freed:
            widths.reasons[name] = f"recomputed in backward: saved only inside checkpointed block {freed[name]}"
        elif name in exact_inputs and blocker is None:
            widths.reasons[name] = (f"kept: an input of checkpointed block {exact_inputs[name]}, which holds it as "
                                    f"it is (none of its inputs needs a gradient)")
        elif name in block_inputs and blocker == "sign":
            widths.reasons[name] = (f"kept: an input of checkpointed block {block_inputs[name]}, which needs its "
                                    f"value (its other savers need only its sign)")
        elif blocker == "sign":
            widths.bits[name] = 1
            widths.reasons[name] = "1-bit mask: its only saver is the ReLU itself, which needs only value > 0"
        elif blocker is not None:
            widths.reasons[name] = blocker
        else:
            widths.candidates.append(name)
            widths.reasons[name] = "kept: not needed for the budget"
    return widths


# -- the width policies ------------------------------------------------------------------------------------------
def _uniform_widths(widths: _Widths, bits: int) -> None:
    """``activation_bits``: every candidate at ``bits`` (32 still routes them through the hooks: a test of the
    machinery)."""
    for name in widths.candidates:
        widths.routed.add(name)
        widths.bits[name] = min(bits, widths.bits[name])
        widths.reasons[name] = f"{bits}-bit copy (activation_bits={bits})"


def _measured_widths(widths: _Widths, memory_budget: float) -> None:
    """``activation_policy="measured"``: the budget met with the least predicted gradient error (the measured
    costs of ``measure_saved``)."""
    options = {}
    for name in widths.candidates:
        value, measured_bits = widths.values[name], widths.values[name].root.meta[BIT_ERRORS_KEY]
        options[name] = [BitsOption(b, value.exact_bytes - value.bytes_at(b, widths.group),
                                    measured_bits[b]["contribution"])
                         for b in SAVED_BITS if b < widths.bits[name] and b >= value.min_bits]
    target = memory_budget * widths.exact_total
    needed = max(0.0, widths.planned_total() - target)
    initial = dict(widths.bits)
    for _ in range(8):
        chosen, _, _, _ = least_error_allocation(widths.candidates, options, needed, None)
        widths.bits.update(initial)
        for name, option in chosen.items():
            widths.bits[name] = option.bits
        over = widths.planned_total() - target
        if over <= 0 or not widths.recomputing:
            break
        # the peak is a re-run on top of the values before it: bytes saved after it did not lower it
        needed += over
    for name, option in chosen.items():
        widths.bits[name] = option.bits
        widths.errors[name] = option.contribution
        widths.reasons[name] = (f"{option.bits}-bit copy: least gradient error per byte saved (predicted "
                                f"{math.sqrt(option.contribution):.3f})"
                                + _floor_note(widths.values[name], option.bits))


def _widest_first(widths: _Widths, memory_budget: float) -> None:
    """``activation_policy="width"``: the widest value lowered one step at a time until the budget is met."""
    values, bits = widths.values, widths.bits
    target = memory_budget * widths.exact_total
    while widths.planned_total() > target:
        lowerable = [n for n in widths.candidates if bits[n] > max(SAVED_BITS[-1], values[n].min_bits)]
        if not lowerable:
            break
        name = max(lowerable, key=lambda n: (bits[n], values[n].bytes_at(bits[n], widths.group)))
        bits[name] = next(step for step in SAVED_BITS if step < bits[name])
        widths.reasons[name] = f"{bits[name]}-bit copy (memory budget)" + _floor_note(values[name], bits[name])


def _rebuilt_widths(gm: torch.fx.GraphModule, widths: _Widths, config: ApproxConfig) -> None:
    """A rebuilt value takes the width of the stored value it is rebuilt from, and says so."""
    rebuilt, bits, values = widths.rebuilt, widths.bits, widths.values
    for name, source in rebuilt.items():
        bits[name] = bits[chain_root(rebuilt, name)]
        if source in rebuilt:
            stored = "rebuilt value"
        elif bits[source] >= dtype_bits(values[source].dtype):
            stored = "exact value"
        else:
            stored = f"{bits[source]}-bit copy"
        root = values[name].root
        recipe = recipe_of(gm, root, config.activation_recompute == "linear")[0]
        op = type(gm.get_submodule(root.target)).__name__ if recipe == "module" else recipe
        widths.reasons[name] = f"recomputed in backward from {source}'s {stored} by {op} (stores nothing)"


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
    order = sorted(blocks, key=lambda b: -b.interior_bytes / max(timings.recompute_seconds[b.name], 1e-9))
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


def _squared_error(widths: _Widths) -> float:
    return sum(widths.errors.values()) + widths.recompute_errors


def _widths_for(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig,
                checkpointed: tuple[Block, ...], compressed_recompute: bool = False) -> tuple[_Widths, bool]:
    """The widths the configured policy chooses with ``checkpointed`` blocks, and whether they were measured."""
    uniform_bits = config.activation_bits
    widths = _initial_widths(gm, config, checkpointed, compressed_recompute)
    measured = config.activation_policy == "measured" and uniform_bits is None and all(
        BIT_ERRORS_KEY in widths.values[n].root.meta for n in widths.candidates)
    if uniform_bits is not None:
        _uniform_widths(widths, uniform_bits)
    elif measured:
        _measured_widths(widths, memory_budget)
    else:
        _widest_first(widths, memory_budget)
    _rebuilt_widths(gm, widths, config)
    return widths, measured


def _value_seconds(compressed: list[tuple[int, int]], rebuilt_bytes: int, timings: MemoryTimings) -> float:
    """Uncalibrated seconds of ``compressed`` copies ``(bits, exact bytes)`` packed and unpacked and of
    ``rebuilt_bytes`` rebuilt in backward (one pass over them, costed like an 8-bit copy)."""
    pack = timings.pack_seconds_per_byte
    return sum(pack.get(bits, 0.0) * size for bits, size in compressed if bits > 1) + pack.get(8, 0.0) * rebuilt_bytes


def _extra_seconds(widths: _Widths, checkpointed: tuple[Block, ...], timings: MemoryTimings) -> float:
    """Predicted seconds a step spends beyond the exact one: blocks re-run, values packed, unpacked and rebuilt."""
    compressed = [(widths.bits[n], widths.values[n].exact_bytes) for n in widths.bits if widths.compressed(n)]
    compressed += [(bits, widths.values[n].exact_bytes) for block in widths.recompute_bits.values()
                   for n, bits in block.items() if bits < dtype_bits(widths.values[n].dtype)]
    rebuilt = sum(widths.values[n].exact_bytes for n in widths.rebuilt)
    return (sum(timings.recompute_seconds[b.name] for b in checkpointed)
            + timings.value_scale * _value_seconds(compressed, rebuilt, timings))


def calibrated_timings(timings: MemoryTimings, memory_plan: MemoryPlan, measured_time: float) -> MemoryTimings:
    """``timings`` with ``value_scale`` set so that ``memory_plan`` (no block checkpointed) is predicted to take
    ``measured_time`` exact steps (the scale stays 1 when it compresses nothing or measured no slower)."""
    compressed = [(v.bits, v.exact_bytes) for v in memory_plan.values if v.compressed]
    rebuilt = sum(v.exact_bytes for v in memory_plan.values if v.recomputed_from is not None)
    modelled = _value_seconds(compressed, rebuilt, timings)
    extra = (measured_time - 1.0) * timings.step_seconds
    if modelled <= 0 or extra <= 0:
        return timings
    return dataclasses.replace(timings, value_scale=extra / modelled)


def _block_decisions(gm: torch.fx.GraphModule, widths: _Widths, blocks: tuple[Block, ...],
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
                      f"step) frees {mib(block.interior_bytes)}")
            if bits:
                held = sum(widths.values[n].bytes_at(b, widths.group) for n, b in bits.items())
                reason += f"; the re-run keeps its values as {RECOMPUTE_BITS}-bit copies ({mib(held)})"
                for name, b in bits.items():
                    value = widths.values[name]
                    if b < dtype_bits(value.dtype):
                        recompute_values.append([value.members[-1].name, b, 1 < b < 16 and _sign_exact(gm, value)])
        else:
            reason = "kept: the budget is met faster (or with less error) without re-running it"
        decisions.append(BlockDecision(
            name=block.name, nodes=list(block.nodes), inputs=list(block.inputs), attributes=list(block.attributes),
            outputs=list(block.outputs), interior_bytes=int(block.interior_bytes), input_bytes=int(block.input_bytes),
            recompute_seconds=float(seconds), checkpointed=checkpointed, reason=reason,
            recompute_bits=RECOMPUTE_BITS if checkpointed and bits else None, recompute_values=recompute_values,
            inputs_copied=checkpointed and widths.copies_inputs(block)))
    return tuple(decisions)


def _memory_plan(gm: torch.fx.GraphModule, widths: _Widths, memory_budget: float | None, uniform_bits: int | None,
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
    eager = sum(n.meta.get(EAGER_SAVED_KEY, 0) for n in gm.graph.nodes)
    eager_text = f"; {mib(eager)} saved by eager code, kept exact" if eager else ""
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
            sign_exact=compressed and 1 < b < 16 and _sign_exact(gm, value), compressed=compressed,
            predicted_error=(math.sqrt(widths.errors.get(name, 0.0))
                             if measured and source is None and name not in widths.freed else None),
            recomputed_from=source, checkpointed_in=widths.freed.get(name)))
    return MemoryPlan(memory_budget=memory_budget, total_exact_bytes=int(exact_total),
                      total_planned_bytes=int(planned), internal_bytes=int(widths.internal), budget_met=met,
                      note=note, values=tuple(decisions), predicted_error=predicted, eager_bytes=int(eager),
                      blocks=blocks, predicted_time=predicted_time, recompute_bytes=int(recompute_bytes))
