"""Pass 6c — measure what compressing each saved value costs the gradients (GACT-style bit choice).

For every saved graph value the memory policy may compress (floating point, at least
``activation_min_bytes``, not a lossless 1-bit ReLU mask): every node that saves the
value (its *savers*) runs forward and backward in isolation on its captured inputs under
its real upstream gradient (the projection loss, as in ``measure_candidates``), once
exactly and ``min(error_draws, 2)`` times with the value's saved copy quantised at 4 bits
the way the runtime would (same group size, rounding and sign-exactness). The relative
bias and noise of each saver's input gradient and weight gradient give the value's
predicted contribution to the squared model-gradient error, with the propagation weights
of the compute policy. As in GACT, the other widths follow from the quantisation step:
the error is proportional to it, so the contribution at ``b`` bits is the 4-bit one times
``((2⁴ − 1) / (2ᵇ − 1))²`` (``benchmarks/bench_planner.py`` measures all three widths on a
2-block char transformer: measured / extrapolated was 0.58–1.42 over its 22 values).
Written to ``node.meta[BIT_ERRORS_KEY]`` of the value's root node:
``{bits: {"contribution": ..., "savers": {saver: {...}}}}``.

The quantised copy is made when autograd unpacks the saved tensor, so a saver that saves
its own output (a ReLU, a sigmoid) is measured the same way as one that saves an input.
A value the plan rebuilds in backward from this one (a LayerNorm's or GELU's output,
``memory_widths.recomputed``) is measured with it: its savers unpack the op re-run on
the quantised copy of this value, as the runtime does, and their errors add to this
value's contribution.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from fxapprox.config import ApproxConfig
from fxapprox.ops.quantize import FLOAT_DTYPES, quantize
from fxapprox.passes.measurement._upstream import ErrorAccumulator, call_node, capture_upstream, total_norm
from fxapprox.passes.measurement.candidates import parameterised
from fxapprox.passes.measurement.error_model import predicted_contribution, propagation_weights
from fxapprox.pipeline.records import BIT_ERRORS_KEY, write_norms
from fxapprox.runtime.recompute import rebuild_view
from fxapprox.runtime.saved_tensors import storage_ptr

__all__ = ["MEASURED_BITS", "SAVED_BITS", "measure_saved_values", "step_ratio"]

#: the widths the memory policy chooses between (below the dtype's own)
SAVED_BITS = (8, 4, 2)
#: the width at which each value is measured; the others are scaled from it by their step size
MEASURED_BITS = 4


def step_ratio(bits: int) -> float:
    """Quantisation step at ``bits`` relative to the measured width's (same range, ``2ᵇ − 1`` steps)."""
    return (2 ** MEASURED_BITS - 1) / (2 ** bits - 1)


class _SaverRunner:
    """Runs one saver node on fresh leaves of its captured inputs, optionally quantising one value's tensors."""

    def __init__(self, gm: torch.fx.GraphModule, node: torch.fx.Node, inputs, grads: dict) -> None:
        self.gm, self.node = gm, node
        self.args, self.kwargs = inputs
        self.grads = grads
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        self.weights = [p for p in module.parameters() if p.requires_grad] if module is not None else []

    def run(self, members: set[str], bits: int | None, config: ApproxConfig, sign_exact: bool, rebuild=None):
        """Forward and backward with the saved tensors of ``members`` quantised at ``bits``; or, with
        ``rebuild = (members, make)``, the saved tensors of those members replaced by ``make()`` (the full
        rebuilt value) cut to their views. Returns ``([], input grads, weight grads)``."""
        leaves_in: list[torch.Tensor] = []
        storages: set[int] = set()
        bases: dict[int, tuple] = {}
        weights = list(self.weights)
        rebuilt_members = rebuild[0] if rebuild is not None else set()

        def fresh(value, arg):
            if not isinstance(value, torch.Tensor):
                return value
            if isinstance(value, torch.nn.Parameter):
                leaf = value.detach().requires_grad_(value.requires_grad)
                if value.requires_grad:
                    weights.append(leaf)
                return leaf
            used = value
            if value.requires_grad:
                leaf = value.detach().requires_grad_(True)
                leaves_in.append(leaf)
                used = leaf.clone()   # an in-place saver (relu_) may write into it
            if isinstance(arg, torch.fx.Node) and arg.name in members:
                storages.add(storage_ptr(used))
            if isinstance(arg, torch.fx.Node) and arg.name in rebuilt_members:
                bases[storage_ptr(used)] = (used.shape, tuple(used.stride()), used.storage_offset())
            return used
        args = tuple(fresh(v, a) for v, a in zip(self.args, self.node.args))
        kwargs = {k: fresh(v, self.node.kwargs.get(k)) for k, v in self.kwargs.items()}
        outputs_storage: set[int] = set()

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            ptr = storage_ptr(tensor)
            if ptr in bases:
                view = (tensor.shape, tuple(tensor.stride()), tensor.storage_offset())
                return rebuild_view(rebuild[1]().to(tensor.dtype), bases[ptr], view)
            if bits is None or tensor.dtype not in FLOAT_DTYPES or not tensor.numel() or \
                    (ptr not in storages and ptr not in outputs_storage):
                return tensor
            copy = quantize(tensor, bits, group_size=config.activation_group_size,
                            rounding=config.activation_rounding, sign_exact=sign_exact, compiled=False)
            return copy.dequantize().view(tensor.shape)

        with saved_tensors_hooks(lambda t: t, unpack):
            result = call_node(self.gm, self.node, args, kwargs)
        leaves = tree_flatten(result)[0]
        if self.node.name in members:
            outputs_storage.update(storage_ptr(t) for t in leaves if isinstance(t, torch.Tensor))
        pairs = [(leaf, self.grads[i]) for i, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and leaf.requires_grad and i in self.grads
                 and isinstance(self.grads[i], torch.Tensor)]
        targets = leaves_in + weights
        grads = [None] * len(targets)
        if pairs and targets:
            grads = list(torch.autograd.grad([p[0] for p in pairs], targets, grad_outputs=[p[1] for p in pairs],
                                             allow_unused=True))
        return [], grads[:len(leaves_in)], grads[len(leaves_in):]


def _rebuilder(gm: torch.fx.GraphModule, by_name: dict, capture, name: str, sources: dict[str, tuple],
               members: set[str], config: ApproxConfig, sign_exact: bool):
    """``make()``: value ``name`` re-run on its captured inputs as backward rebuilds it — its source quantised at
    the measured width when it is the stored value (``members``), rebuilt the same way first when it is rebuilt
    too (``sources``: rebuilt value → (its source, the source's members)); a fresh draw each call."""

    def rebuild(value_name: str) -> torch.Tensor:
        node = by_name[value_name]
        args, kwargs = capture.inputs[node]
        source, source_members = sources[value_name]

        def replaced(value, arg):
            if not isinstance(arg, torch.fx.Node) or not isinstance(value, torch.Tensor):
                return value
            if source in sources and arg.name in source_members:
                return rebuild(source).to(value.dtype)
            if arg.name in members:
                copy = quantize(value.detach(), MEASURED_BITS, group_size=config.activation_group_size,
                                rounding=config.activation_rounding, sign_exact=sign_exact, compiled=False)
                return copy.dequantize().view(value.shape)
            return value

        return call_node(gm, node, tuple(replaced(v, a) for v, a in zip(args, node.args)),
                         {k: replaced(v, node.kwargs.get(k)) for k, v in kwargs.items()})

    def make() -> torch.Tensor:
        with torch.no_grad():
            return rebuild(name)
    return make


def measure_saved_values(gm: torch.fx.GraphModule, *example_inputs, values: dict, config: ApproxConfig,
                         progress: bool = False) -> torch.fx.GraphModule:
    """Measure each candidate value's gradient cost at every width (``values``: name → (members, savers,
    sign_exact), from the memory policy). Run inside the analysis sandbox.

    Example::

        >>> measure_saved_values(gm, x, values={"relu": ({"relu"}, {"conv2"}, True, [])}, config=ApproxConfig())
        >>> gm.graph.find_nodes(op="call_function", target=torch.relu)[0].meta[BIT_ERRORS_KEY][4]
    """
    if not values:
        return gm
    by_name = {n.name: n for n in gm.graph.nodes}
    savers = {by_name[s] for _, saver_names, _, rebuilt in values.values()
              for s in list(saver_names) + [s for entry in rebuilt for s in entry[2]] if s in by_name}
    # A rebuilt value's own node is captured too: its inputs are what backward re-runs it on.
    rebuilders = {by_name[entry[0]] for *_, rebuilt in values.values() for entry in rebuilt}
    torch.manual_seed(0)
    capture = capture_upstream(gm, savers | rebuilders, {n for n in gm.graph.nodes if parameterised(gm, n)},
                               example_inputs)
    # in graph order: a saver that is a sampled op draws from the global generator, and a set's order would make
    # the later draws differ from run to run (reproducible plans)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    runners = {node: _SaverRunner(gm, node, capture.inputs[node], capture.grads.get(node, {}))
               for node in sorted(savers, key=order.__getitem__)}
    exact = {node: runner.run(set(), None, config, False) for node, runner in runners.items()}
    for node, (_, input_grads, _) in exact.items():
        write_norms(node, input_grad=total_norm(input_grads))
    weights, owners = propagation_weights(gm, savers)
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("measuring saved-activation widths", total=len(values))
        for name, (members, saver_names, sign_exact, rebuilt) in values.items():
            contribution, per_saver = 0.0, {}
            jobs = [(saver_name, None) for saver_name in sorted(saver_names)]
            members_of = {entry[0]: entry[1] for entry in rebuilt}
            sources = {entry[0]: (entry[3], members_of.get(entry[3], members)) for entry in rebuilt}
            for rebuilt_name, rebuilt_members, rebuilt_savers, _ in rebuilt:
                make = _rebuilder(gm, by_name, capture, rebuilt_name, sources, members, config, sign_exact)
                jobs += [(saver_name, (rebuilt_members, make)) for saver_name in sorted(rebuilt_savers)]
            for saver_name, rebuild in jobs:
                node = by_name.get(saver_name)
                if node not in runners:
                    continue
                accumulator = ErrorAccumulator(exact[node])
                for _ in range(min(config.error_draws, 2)):
                    if rebuild is None:
                        accumulator.add(runners[node].run(set(members), MEASURED_BITS, config, sign_exact))
                    else:
                        accumulator.add(runners[node].run(set(), None, config, False, rebuild=rebuild))
                errors, bias, noise = accumulator.errors(config.noise_horizon)
                key = saver_name if rebuild is None else f"{saver_name} (rebuilt {next(iter(rebuild[0]))})"
                per_saver[key] = {"errors": errors, "bias": bias, "noise": noise}
                contribution += predicted_contribution(errors, weights.get(saver_name, 0.0), owners)
            by_name[name].meta[BIT_ERRORS_KEY] = {
                bits: {"contribution": contribution * step_ratio(bits) ** 2,
                       "savers": per_saver if bits == MEASURED_BITS else {}} for bits in SAVED_BITS}
            bar.advance(task)
    return gm
