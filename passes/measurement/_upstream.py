"""Shared machinery of the two measuring passes (``measure_candidates``, ``measure_saved``).

* :class:`UpstreamCapture` runs the model exactly once, keeps the inputs of the nodes to measure
  and taps their outputs, so that one backward of the projection loss hands every one of them its
  real upstream gradient; it also records the norms the policies' propagation weights need.
  :func:`capture_upstream` does that run and writes the norms into ``node.meta``.
* :class:`ErrorAccumulator` turns several runs of an approximate node into the relative bias and
  noise of each quantity it changes.
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxapprox.pipeline._projection import projection_loss
from fxapprox.pipeline.records import write_norms

__all__ = ["ErrorAccumulator", "UpstreamCapture", "call_node", "capture_upstream", "norm", "total_norm"]


class _Tap(torch.autograd.Function):
    """Identity whose backward records the gradient flowing into a node's output (or only its norm)."""

    @staticmethod
    def forward(ctx, x, store, index, keep):
        ctx.store, ctx.index, ctx.keep = store, index, keep
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store[ctx.index] = grad.detach().clone() if ctx.keep else float(grad.detach().float().norm())
        return grad, None, None, None


def norm(value) -> float | None:
    return float(value.detach().float().norm()) if isinstance(value, torch.Tensor) and value.numel() else None


def total_norm(tensors) -> float | None:
    """The norm of the tensors taken together (``None`` when there are none), without concatenating them."""
    parts = [norm(t) for t in tensors if t is not None]
    parts = [p for p in parts if p is not None]
    return math.sqrt(sum(p * p for p in parts)) if parts else None


class UpstreamCapture(torch.fx.Interpreter):
    """Runs the graph exactly: keeps the inputs of the ``wanted`` nodes and taps their outputs; for the
    ``observed`` ones (every parameterised node) records the norms of input, output and output gradient."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set, observed: set) -> None:
        super().__init__(gm)
        self.wanted, self.observed = wanted, observed | wanted
        self.inputs: dict = {}
        self.grads: dict = {}
        self.norms: dict = {}

    def run_node(self, n):
        if n not in self.observed:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        keep = n in self.wanted
        if keep:
            self.inputs[n] = tree_map(_detached_copy, (args, kwargs))
        activation = next((a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)),
                          None)
        result = super().run_node(n)
        leaves, spec = tree_flatten(result)
        self.norms[n] = {"input": norm(activation), "output": norm(leaves[0]) if leaves else None}
        store = self.grads.setdefault(n, {})
        tapped = [_Tap.apply(leaf, store, i, keep) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf
                  for i, leaf in enumerate(leaves)]
        return tree_unflatten(tapped, spec)


def _detached_copy(value):
    if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    copy.requires_grad_(value.requires_grad and (value.is_floating_point() or value.is_complex()))
    return copy


def call_node(gm: torch.fx.GraphModule, node: torch.fx.Node, args, kwargs):
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def capture_upstream(gm: torch.fx.GraphModule, wanted: set, observed: set, example_inputs) -> UpstreamCapture:
    """Run ``gm`` once exactly and backward the projection loss (nothing is written into ``.grad``); record
    every observed node's input, output and output-gradient norms (its ``ActivationNorms`` record)."""
    capture = UpstreamCapture(gm, wanted, observed)
    loss = projection_loss(capture.run(*example_inputs))
    parameters = [p for p in gm.parameters() if p.requires_grad]
    if loss.requires_grad and parameters:
        # Every tap lies between its layer's own weights and the loss, so each one's backward runs.
        torch.autograd.grad(loss, parameters, allow_unused=True)
    for node, norms in capture.norms.items():
        grad = capture.grads.get(node, {}).get(0)
        write_norms(
            node, input=norms["input"], output=norms["output"],
            output_grad=grad if isinstance(grad, float) or grad is None else norm(grad))
    return capture


def _flat(tensors) -> list[torch.Tensor] | None:
    parts = [t.detach().reshape(-1).float() for t in tensors if t is not None]
    return parts or None


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum(torch.dot(x, y).double() for x, y in zip(a, b)))


class ErrorAccumulator:
    """Bias and noise of each changed quantity over runs, relative to the exact one's norm.

    Over ``D`` runs with estimates ``ĝ_d`` of the exact ``g``: the noise is the sample variance
    ``Σ‖ĝ_d − ḡ‖² / (D − 1)`` and the squared bias ``‖ḡ − g‖² − noise / D`` (the mean's own noise
    removed). A deterministic method has no noise: its whole error is bias. Sums stay in fp32
    tensors (dot products accumulate in fp64): the measurement costs a few passes over each
    quantity, not a copy in double precision.
    """

    NAMES = ("output", "input_grad", "weight_grad")

    def __init__(self, exact: tuple) -> None:
        self.exact = {name: _flat(values) for name, values in zip(self.NAMES, exact)}
        self.sums: dict = {name: None for name in self.NAMES}
        self.squares = {name: 0.0 for name in self.NAMES}
        self.runs = 0

    def add(self, result: tuple) -> None:
        for name, values in zip(self.NAMES, result):
            reference, estimate = self.exact[name], _flat(values)
            if reference is None:
                continue
            if estimate is None or len(estimate) != len(reference):
                estimate = [torch.zeros_like(r) for r in reference]
            if self.sums[name] is None:
                self.sums[name] = [e.clone() for e in estimate]
            else:
                for total, part in zip(self.sums[name], estimate):
                    total.add_(part)
            self.squares[name] += _dot(estimate, estimate)
        self.runs += 1

    def errors(self, horizon: float) -> tuple[dict, dict, dict]:
        """``(effective, bias, noise)``: relative; effective² = bias² + noise² / horizon."""
        effective, bias, noise = {}, {}, {}
        for name, reference in self.exact.items():
            if reference is None or self.sums[name] is None:
                effective[name] = bias[name] = noise[name] = 0.0
                continue
            runs = self.runs
            mean = [total / runs for total in self.sums[name]]
            spread = max(self.squares[name] - runs * _dot(mean, mean), 0.0)
            variance = spread / (runs - 1) if runs > 1 else 0.0
            difference = [m - r for m, r in zip(mean, reference)]
            squared_bias = max(_dot(difference, difference) - variance / runs, 0.0)
            norm_sq = _dot(reference, reference)
            if norm_sq == 0.0:
                zero = squared_bias == 0.0 and variance == 0.0
                effective[name] = bias[name] = noise[name] = 0.0 if zero else math.inf
                continue
            bias[name] = math.sqrt(squared_bias / norm_sq)
            noise[name] = math.sqrt(variance / norm_sq)
            effective[name] = math.sqrt((squared_bias + variance / horizon) / norm_sq)
        return effective, bias, noise
