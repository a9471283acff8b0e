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
   :data:`~fxapprox.saved_activations.RECOMPUTABLE_FUNCTIONS` whose input is saved
   anyway (a LayerNorm and a GELU save their input themselves) is *recomputed*: backward
   re-runs the op on the input's saved copy, so it keeps no bytes of its own and shares
   its input's width (``activation_recompute``; the pair is measured together). When the
   budget cannot be met otherwise with every value at 8 bits or more
   (:func:`resolve_recompute`), plain Linear outputs are rebuilt too, through chains of
   rebuilt values (a feed-forward block's LayerNorm → Linear → GELU from the residual
   stream's copy).
3. Then the bits of the others. With ``activation_policy="measured"`` (default)
   each value's cost at 8, 4 and 2 bits has been measured on the example batch
   (``passes/measure_saved.py``: its savers' gradient errors, as GACT adapts bits
   to measured sensitivity), and the widths are chosen with the least predicted
   model-gradient error that fits the budget (the same least-error allocation as
   the compute policy, per byte saved). With ``"width"`` the policy lowers the
   value with the most bits left (largest first) by one step, exact → 8 → 4 → 2,
   until the total fits: even widths, blind to what each value's error costs.
   Either way the inputs attention saves (q, k, v of ``scaled_dot_product_attention``)
   keep at least 8 bits: its backward exponentiates their product
   (``fxapprox.passes.saved_values.EXPONENTIATING_SAVERS``).
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
from fxapprox.plan import MemoryPlan, SavedValueDecision
from fxapprox.passes._allocation import least_error_allocation
from fxapprox.records import BIT_ERRORS_KEY, EAGER_SAVED_KEY, saved_of
from fxapprox.recompute import RECOMPUTABLE_FUNCTIONS, RECOMPUTABLE_METHODS, RECOMPUTABLE_MODULES
from fxapprox.passes.measure_saved import SAVED_BITS
from fxapprox.passes.saved_values import SavedValue, dtype_bits, is_relu, mib, saved_values

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


def _floor_note(value: SavedValue, bits: int) -> str:
    if not value.min_bits or bits > value.min_bits:
        return ""
    return (f"; no fewer than {value.min_bits} bits: {value.floor_saver} exponentiates a product of its saved "
            f"inputs in backward")


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

    @property
    def exact_total(self) -> int:
        return sum(v.exact_bytes for v in self.values.values()) + self.internal

    def planned_bytes(self, name: str) -> int:
        return 0 if name in self.rebuilt else self.values[name].bytes_at(self.bits[name], self.group)

    def planned_total(self) -> int:
        return sum(self.planned_bytes(n) for n in self.bits) + self.planned_internal


def _initial_widths(gm: torch.fx.GraphModule, config: ApproxConfig) -> _Widths:
    """Every value at its dtype's width, the rebuilt ones chosen, the ineligible ones with their reason."""
    values, internal, internal_bool = saved_values(gm)
    widths = _Widths(values, _recomputed(gm, values, config), config.activation_group_size, internal,
                     internal - internal_bool + (internal_bool + 7) // 8)
    for name in widths.rebuilt:  # a rebuilt value's floor (attention reads it) binds the value it is rebuilt from
        root = values[chain_root(widths.rebuilt, name)]
        if values[name].min_bits > root.min_bits:
            root.min_bits, root.floor_saver = values[name].min_bits, values[name].floor_saver
    for name, value in values.items():
        widths.bits[name] = dtype_bits(value.dtype)
        blocker = _eligibility(value, config)
        if name in widths.rebuilt:
            continue
        if blocker == "sign":
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
    needed = max(0.0, widths.planned_total() - memory_budget * widths.exact_total)
    chosen, _, _, _ = least_error_allocation(widths.candidates, options, needed, None)
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
    total = widths.planned_total()
    while total > target:
        lowerable = [n for n in widths.candidates if bits[n] > max(SAVED_BITS[-1], values[n].min_bits)]
        if not lowerable:
            break
        name = max(lowerable, key=lambda n: (bits[n], values[n].bytes_at(bits[n], widths.group)))
        before = values[name].bytes_at(bits[name], widths.group)
        bits[name] = next(step for step in SAVED_BITS if step < bits[name])
        total -= before - values[name].bytes_at(bits[name], widths.group)
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


def plan_memory(gm: torch.fx.GraphModule, memory_budget: float | None, config: ApproxConfig) -> MemoryPlan | None:
    """Decide the bits of every saved value; ``None`` when activations are not to be compressed.

    Example::

        >>> plan = plan_memory(gm, 0.125, ApproxConfig())   # after measure_saved_bytes
        >>> plan.achieved <= 0.125
        True
    """
    uniform_bits = config.activation_bits
    if uniform_bits is None and (memory_budget is None or memory_budget >= 1.0):
        return None
    widths = _initial_widths(gm, config)
    measured = config.activation_policy == "measured" and uniform_bits is None and all(
        BIT_ERRORS_KEY in widths.values[n].root.meta for n in widths.candidates)
    if uniform_bits is not None:
        _uniform_widths(widths, uniform_bits)
    elif measured:
        _measured_widths(widths, memory_budget)
    else:
        _widest_first(widths, memory_budget)
    _rebuilt_widths(gm, widths, config)
    return _memory_plan(gm, widths, memory_budget, uniform_bits, measured)


def _memory_plan(gm: torch.fx.GraphModule, widths: _Widths, memory_budget: float | None, uniform_bits: int | None,
                 measured: bool) -> MemoryPlan:
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
                if bits[n] >= dtype_bits(v.dtype) and n not in widths.candidates and n not in rebuilt]
        why_not = (f", NOT met: every eligible value is at its lowest width; {len(kept)} values ({mib(sum(kept))}) "
                   f"and {mib(widths.planned_internal)} of temporaries stay as they are")
    predicted = math.sqrt(sum(widths.errors.values())) if measured else None
    error_text = "" if predicted is None else f"; predicted model-gradient error {predicted:.3f}"
    eager = sum(n.meta.get(EAGER_SAVED_KEY, 0) for n in gm.graph.nodes)
    eager_text = f"; {mib(eager)} saved by eager code, kept exact" if eager else ""
    note = (f"saved activations: exact {mib(exact_total)}, planned {mib(planned)} "
            f"({planned / exact_total if exact_total else 1.0:.3f} of exact; {budget_text}{why_not}{error_text}"
            f"{eager_text})")
    decisions = []
    for name, value in values.items():
        b = bits[name]
        source = rebuilt.get(name)
        compressed = source is None and (b < dtype_bits(value.dtype) or name in widths.routed)
        decisions.append(SavedValueDecision(
            node=name, shape=value.shape, dtype=str(value.dtype).replace("torch.", ""),
            exact_bytes=value.exact_bytes, planned_bytes=widths.planned_bytes(name), bits=b,
            reason=widths.reasons[name], savers=sorted(value.savers), aliases=[m.name for m in value.members[1:]],
            sign_exact=compressed and 1 < b < 16 and _sign_exact(gm, value), compressed=compressed,
            predicted_error=(math.sqrt(widths.errors.get(name, 0.0)) if measured and source is None else None),
            recomputed_from=source))
    return MemoryPlan(memory_budget=memory_budget, total_exact_bytes=int(exact_total),
                      total_planned_bytes=int(planned), internal_bytes=int(widths.internal), budget_met=met,
                      note=note, values=tuple(decisions), predicted_error=predicted, eager_bytes=int(eager))
