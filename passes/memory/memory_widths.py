"""The memory policy's values and widths (``fxapprox.passes.memory.memory_policy``): which saved values may be
compressed and why not, which are rebuilt in backward from another value's copy (``recipe_of``), the working state of
a plan's widths (:class:`Widths`: every value's bits, reasons, what checkpointed blocks free and hold) and the width
policies that fill it — least measured error per byte, widest first, or one width for all.
"""


from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx
from torch import nn

from fxapprox.config import ApproxConfig
from fxapprox.passes.memory.blocks import Block, node_bytes
from fxapprox.passes.memory.measure_saved import SAVED_BITS
from fxapprox.passes.memory.saved_values import SavedValue, dtype_bits, is_relu, saved_values
from fxapprox.passes.policy._allocation import least_error_allocation
from fxapprox.pipeline.records import BIT_ERRORS_KEY, EAGER_COPY_KEY, EAGER_SAVED_KEY, saved_of
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


def recomputed(gm: torch.fx.GraphModule, values: dict[str, SavedValue], config: ApproxConfig) -> dict[str, str]:
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
        if found is None or value.derived or eligibility(value, config) is not None:
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
            if not values[source].direct or eligibility(values[source], config) == "sign":
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


def sign_exact(gm: torch.fx.GraphModule, value: SavedValue) -> bool:
    """The tensor's last writer is a ReLU (views do not write; in-place ops do)."""
    writers = [value.root] + [m for m in value.members[1:] if saved_of(m).inplace]
    return is_relu(gm, writers[-1])


def eligibility(value: SavedValue, config: ApproxConfig) -> str | None:
    """Why a value keeps its bits (or ``"sign"``: a lossless 1-bit mask), ``None`` when its bits are chosen."""
    if value.dtype is None or not value.dtype.is_floating_point:
        return "kept: not a floating-point tensor"
    if value.exact_bytes < config.activation_min_bytes:
        return f"kept: small ({value.exact_bytes} B < activation_min_bytes)"
    if value.sign_only and config.activation_bits != 32:
        return "sign"
    return None


@dataclasses.dataclass
class Widths:
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
    eager_bytes: int = 0                 # of ``internal``, what eager code saves (a region-captured model)
    eager_copy_bytes: int = 0            # the same, kept as copies (``EAGER_COPY_KEY``)
    copy_eager: bool = False             # whether the plan keeps eager code's saves as copies

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
        blocker = eligibility(value, config)
        widths[name] = (1 if blocker == "sign" else dtype_bits(value.dtype) if blocker is not None
                        else max(RECOMPUTE_BITS, value.min_bits))
    return widths


def eager_saved_totals(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """What eager code saves in a region-captured model's planning graph: ``(exact bytes, bytes as copies)``."""
    exact = sum(n.meta.get(EAGER_SAVED_KEY, 0) for n in gm.graph.nodes)
    return exact, sum(n.meta.get(EAGER_COPY_KEY, n.meta.get(EAGER_SAVED_KEY, 0)) for n in gm.graph.nodes)


def initial_widths(gm: torch.fx.GraphModule, config: ApproxConfig, checkpointed: tuple[Block, ...] = (),
                    compressed_recompute: bool = False, copy_eager: bool = False) -> Widths:
    """Every value at its dtype's width, the rebuilt ones chosen, the ineligible ones with their reason; with
    ``checkpointed`` blocks, the values only they save freed, their inputs held by the checkpoint and what each
    re-run holds (with ``compressed_recompute``, as copies where its inputs let the re-run be reentrant); with
    ``copy_eager``, eager code's saves (a region-captured model) kept as copies."""
    values, internal, internal_bool = saved_values(gm)
    freed = {name: block.name for block in checkpointed for name in block.interior}
    root_of = {m.name: name for name, value in values.items() for m in value.members}
    exact_inputs = {root_of[i]: block.name for block in checkpointed if not block.inputs_need_grad
                    for i in block.inputs if i in root_of}
    rebuilt = recomputed(gm, values, config)
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
    widths = Widths(values, rebuilt, config.activation_group_size, internal,
                     internal - internal_bool + (internal_bool + 7) // 8, freed=freed,
                     held=sum(node_bytes(by_name[i]) for i in held))
    # eager code inside a checkpointed module is freed with it; the rest may be kept as copies
    freed_eager = sum(block.eager_bytes for block in checkpointed)
    eager_exact, eager_copied = eager_saved_totals(gm)
    widths.eager_bytes = eager_exact - freed_eager
    widths.eager_copy_bytes = eager_copied - sum(block.eager_copy_bytes for block in checkpointed)
    widths.planned_internal -= freed_eager
    widths.copy_eager = copy_eager and widths.eager_copy_bytes < widths.eager_bytes
    if widths.copy_eager:
        widths.planned_internal -= widths.eager_bytes - widths.eager_copy_bytes
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
        if compressed_recompute and block.inputs_need_grad and not block.module_level:
            widths.recompute_bits[block.name] = _recompute_widths(values, block, config)
            bits = widths.recompute_bits[block.name]
            held_bytes = sum(values[n].bytes_at(bits[n], widths.group) for n in block.interior)
            widths.recompute_errors += sum(
                values[n].root.meta[BIT_ERRORS_KEY][bits[n]]["contribution"] for n in block.interior
                if bits[n] in SAVED_BITS and BIT_ERRORS_KEY in values[n].root.meta)
        else:
            held_bytes = block.interior_bytes + block.eager_bytes
        widths.recomputing.append((order[block.nodes[-1]], held_bytes, block))
    for name in widths.rebuilt:  # a rebuilt value's floor (attention reads it) binds the value it is rebuilt from
        root = values[chain_root(widths.rebuilt, name)]
        if values[name].min_bits > root.min_bits:
            root.min_bits, root.floor_saver = values[name].min_bits, values[name].floor_saver
            root.floor_reason = values[name].floor_reason
    for name, value in values.items():
        widths.bits[name] = dtype_bits(value.dtype)
        blocker = eligibility(value, config)
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
def uniform_widths(widths: Widths, bits: int) -> None:
    """``activation_bits``: every candidate at ``bits`` (32 still routes them through the hooks: a test of the
    machinery)."""
    for name in widths.candidates:
        widths.routed.add(name)
        widths.bits[name] = min(bits, widths.bits[name])
        widths.reasons[name] = f"{bits}-bit copy (activation_bits={bits})"


def measured_widths(widths: Widths, memory_budget: float) -> None:
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


def widest_first(widths: Widths, memory_budget: float) -> None:
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


def rebuilt_widths(gm: torch.fx.GraphModule, widths: Widths, config: ApproxConfig) -> None:
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
