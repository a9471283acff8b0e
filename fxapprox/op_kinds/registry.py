"""One registry of approximable op kinds: everything a kind needs, in one handler.

Each approximable kind of graph node (an ``nn.Linear``, a ``F.conv2d`` call, an
``x @ W`` with a parameter operand, an ``nn.LSTM`` …) is one registered
:class:`OpKind`. The passes ask the registry and never test kind names
themselves:

* ``match`` — whether a node is of this kind, and its channels (the channels pass);
* ``blocker`` — why a node of this kind cannot be approximated (the planner's reasons);
* ``modes`` / ``methods`` / ``mode_blocker`` — the candidates it offers, and why one
  does not fit this node (too few output features for a sampled input gradient, …);
* ``candidate_flops`` — the training FLOPs of a candidate;
* ``approximate_call`` — the candidate as a callable on the node's own arguments,
  which the error and speed measurement runs in isolation;
* ``rewrite`` — put the chosen candidate into the graph;
* ``gradient_operands`` — which of the node's inputs are its weights (for the
  weight-gradient error).

This mirrors torchao's one-registered-transform-per-config: a new kind is one
class and one :func:`register_op_kind` call; the built-in kinds are in :mod:`fxapprox.op_kinds.builtin`.

Example::

    >>> from fxapprox.op_kinds import OP_KINDS
    >>> sorted(OP_KINDS)
    ['conv1d_hf', 'conv2d', 'conv2d_fn', 'linear', 'linear_fn', 'lstm', 'matmul']
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxapprox.ops.lstm import LSTMBackward
from fxapprox.ops.sampling import kept_count, rounded_count
from fxapprox.pipeline.records import flops_of, kind_of, tensor_of
from fxapprox.runtime.modules import SamplingSpec

MATMUL_TARGETS = (torch.matmul, operator.matmul, torch.mm)
LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
CONV2D_TARGETS = (F.conv2d, torch.conv2d)
CONV2D_ARG_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV2D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}

_NOT_SAMPLED = "{module_type}: only Linear, Conv2d, LSTM, linear, conv2d and matmul are sampled"
_RECURRENT = "recurrent layer ({module_type}): no sparse-backward version yet"
#: why a functional op of an approximable kind without a parameter operand stays exact
NO_PARAMETER_OPERAND = "no parameter operand (both operands are activations)"
#: layer kinds that are recognised but have no approximate version: (module type, kind, why it stays exact)
UNSUPPORTED_MODULES: tuple[tuple[type[nn.Module], str, str], ...] = (
    (nn.Conv1d, "conv1d", _NOT_SAMPLED), (nn.Conv3d, "conv3d", _NOT_SAMPLED),
    (nn.ConvTranspose1d, "conv_transpose1d", _NOT_SAMPLED), (nn.ConvTranspose2d, "conv_transpose2d", _NOT_SAMPLED),
    (nn.ConvTranspose3d, "conv_transpose3d", _NOT_SAMPLED), (nn.GRU, "gru", _RECURRENT), (nn.RNN, "rnn", _RECURRENT),
)


def conv2d_call_args(node: torch.fx.Node) -> dict:
    """The arguments of a ``F.conv2d`` call node by name, defaults filled in."""
    values = dict(CONV2D_DEFAULTS)
    values.update(zip(CONV2D_ARG_NAMES, node.args))
    values.update(node.kwargs)
    return values


def linear_call_args(args: tuple, kwargs: dict) -> tuple:
    """``(input, weight, bias)`` of a ``F.linear`` call from its positional and keyword arguments."""
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs.get(name) for name in names[len(args):]]
    return tuple(values[:3])


def parameter_of(gm: torch.fx.GraphModule, arg) -> nn.Parameter | None:
    """The ``nn.Parameter`` a ``get_attr`` node refers to, or ``None``."""
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = gm
        for part in arg.target.split("."):
            value = getattr(value, part, None)
        if isinstance(value, nn.Parameter):
            return value
    return None


class OpKind:
    """Base handler: override what the kind needs (see the module docstring)."""

    #: the ``op_kind`` of its nodes' :class:`~fxapprox.pipeline.records.LayerKind`
    name: str = ""
    #: sampling modes this kind offers (see ``fxapprox.runtime.modules.MODES``)
    modes: tuple[str, ...] = ("forward", "backward", "weight_grad")
    #: methods it offers (``None``: every registered method)
    methods: tuple[str, ...] | None = None
    #: whether its top-k candidates draw ``ApproxConfig.random_share`` of their pairs at random
    uses_random_share: bool = True

    # -- matching ------------------------------------------------------------
    def match(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict | None:
        """Channel info (``in_channels``, ``out_channels``, ``reduction_size``, …) or ``None``."""
        raise NotImplementedError

    def blocker(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
        """Why this node cannot be approximated at all, or ``None``."""
        return None

    def batch_rows(self, node: torch.fx.Node) -> int:
        """Rows of the layer's GEMM for batch-row sampling, from its output shape: its batch (``shape[0]``, as for a
        convolution). A kind with its features last (a linear layer: batch × tokens rows) overrides it with
        :func:`leading_rows`."""
        shape = tensor_of(node).shape
        return shape[0] if shape and all(isinstance(s, int) for s in shape) else 0

    def mode_blocker(self, node: torch.fx.Node, mode: str, ratio: float, min_k: int, min_channels: int) -> str | None:
        """Why ``mode`` at keep-ratio ``ratio`` does not fit this node, or ``None``.

        Every sampled dimension must keep at least ``min_k`` entries; a sampled input
        gradient also needs ``min_channels`` output features to choose from (sampling
        2 of a classifier's 10 outputs starves every layer below of 8 classes' gradient).
        """
        if mode not in self.modes:
            return f"{mode} sampling is not offered for {self.name}"
        kind = kind_of(node)
        if mode == "weight_grad" and not kind.weight_requires_grad:
            return "frozen weight (no weight gradient to sample)"
        n = kind.reduction_size or 0
        if mode == "forward":
            k = kept_count(ratio, n)
            return f"k={k} at keep-ratio {ratio:g} < min_k={min_k}" if k < min_k else None
        # what the sampled op keeps of the other dimensions it samples (fxapprox.ops.sampling.rounded_count)
        rows = self.batch_rows(node)
        kept_rows = rounded_count(ratio, rows) if rows else 0
        if kept_rows < min_k:
            return f"{kept_rows} of {rows} batch rows at keep-ratio {ratio:g} < min_k={min_k}"
        if mode == "backward":
            out = kind.out_channels or 0
            if out < min_channels:
                return f"input-gradient sampling over {out} outputs < min_channels={min_channels}"
            if rounded_count(ratio, out) < min_k:
                return f"{rounded_count(ratio, out)} of {out} outputs at keep-ratio {ratio:g} < min_k={min_k}"
        return None

    # -- cost ----------------------------------------------------------------
    def weight_grad_flops(self, node: torch.fx.Node) -> int:
        """FLOPs of the weight-gradient product (for these kinds: the forward product's, when it exists)."""
        return flops_of(node).forward if kind_of(node).weight_requires_grad else 0

    def candidate_flops(self, node: torch.fx.Node, mode: str, keep_ratio: float) -> int:
        """Training FLOPs (forward + backward) of the node approximated with ``mode`` at ``keep_ratio``."""
        forward, backward = flops_of(node).forward, flops_of(node).backward
        if mode == "forward":
            sampled = forward + backward
        elif mode == "backward":
            sampled = backward
        else:
            sampled = min(backward, self.weight_grad_flops(node))
        return round(forward + backward - (1.0 - keep_ratio) * sampled)

    # -- building ------------------------------------------------------------
    def build(self, gm: torch.fx.GraphModule, node: torch.fx.Node, spec: SamplingSpec,
              lstm: LSTMBackward = LSTMBackward()) -> nn.Module:
        """The approximate module for ``node`` (sharing the original's parameters)."""
        raise NotImplementedError

    def call_args(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple:
        """The built module's positional arguments, from the node's own (for call_module kinds: as they are)."""
        return tuple(args)

    def approximate_call(self, gm: torch.fx.GraphModule, node: torch.fx.Node, spec: SamplingSpec,
                         lstm: LSTMBackward = LSTMBackward()) -> Callable:
        """``f(*args, **kwargs)`` computing the node approximately (training mode) on its own arguments."""
        module = self.build(gm, node, spec, lstm).train()

        def call(*args, **kwargs):
            return module(*self.call_args(node, args, kwargs), **(kwargs if node.op == "call_module" else {}))
        return call

    def rewrite(self, gm: torch.fx.GraphModule, node: torch.fx.Node, spec: SamplingSpec,
                lstm: LSTMBackward = LSTMBackward()) -> None:
        """Replace ``node`` in ``gm`` by its approximate version (``gm`` is recompiled by the caller)."""
        module = self.build(gm, node, spec, lstm)
        if node.op == "call_module":
            gm.add_submodule(node.target, module)
            return
        module_name = f"fxapprox_{node.name}"
        gm.add_submodule(module_name, module)
        node.op, node.target, node.args, node.kwargs = ("call_module", module_name,
                                                        self.call_args(node, node.args, node.kwargs), {})

    def gradient_operands(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[list[int], list[str]]:
        """``(positions of the node's weight arguments, names of its module's weight parameters)``."""
        return [], []


_REGISTRY: dict[str, OpKind] = {}
#: the registered kinds by name (read-only use; register with :func:`register_op_kind`)
OP_KINDS = _REGISTRY


def register_op_kind(handler: OpKind) -> OpKind:
    """Register ``handler`` (an :class:`OpKind` instance) under ``handler.name``; returns it."""
    if not isinstance(handler, OpKind) or not handler.name:
        raise TypeError(f"handler must be an OpKind instance with a name, got {handler!r}")
    if handler.name in _REGISTRY:
        raise ValueError(f"op kind {handler.name!r} is already registered")
    _REGISTRY[handler.name] = handler
    return handler


def leading_rows(node: torch.fx.Node) -> int:
    """Every leading dimension of the node's output (batch × tokens): the GEMM rows of a kind with features last."""
    shape = tensor_of(node).shape
    return math.prod(shape[:-1]) if shape and all(isinstance(s, int) for s in shape) else 0


def is_matmul(node: torch.fx.Node) -> bool:
    return node.target in MATMUL_TARGETS or (node.op == "call_method" and node.target == "matmul")


def match_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[OpKind | None, dict]:
    """The registered kind of ``node`` and its channel info; ``(None, info)`` for every other node
    (``info["op_kind"]`` still names a recognised kind without an approximate version, with ``info["unsupported"]``
    saying why it stays exact, or ``None``)."""
    for handler in _REGISTRY.values():
        info = handler.match(gm, node)
        if info is not None:
            return handler, {"op_kind": handler.name, "approximable": True, **info}
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        for module_type, kind, reason in UNSUPPORTED_MODULES:
            if isinstance(module, module_type):
                return None, {"op_kind": kind, "module_type": type(module).__name__,
                              "unsupported": reason.format(module_type=type(module).__name__)}
        return None, {"op_kind": None, "module_type": type(module).__name__}
    if node.op in ("call_function", "call_method") and is_matmul(node):
        return None, {"op_kind": "matmul", "parameter_operand": False, "unsupported": NO_PARAMETER_OPERAND}
    if node.op == "call_function" and node.target in LINEAR_TARGETS + CONV2D_TARGETS:
        kind = "linear_fn" if node.target in LINEAR_TARGETS else "conv2d_fn"
        return None, {"op_kind": kind, "parameter_operand": False, "unsupported": NO_PARAMETER_OPERAND}
    return None, {"op_kind": None}


def handler_for(node: torch.fx.Node) -> OpKind | None:
    """The handler of an annotated node (``None`` when no registered kind matched it: an
    activation @ activation matmul is ``op_kind="matmul"`` but not approximable)."""
    kind = kind_of(node)
    return _REGISTRY.get(kind.op_kind) if kind.approximable else None


__all__ = ["OP_KINDS", "OpKind", "conv2d_call_args", "handler_for", "kept_count", "leading_rows", "linear_call_args",
           "match_node",
           "parameter_of", "register_op_kind"]
