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
class and one :func:`register_op_kind` call.

Example::

    >>> from fxapprox.op_kinds import OP_KINDS
    >>> sorted(OP_KINDS)
    ['conv2d', 'conv2d_fn', 'linear', 'linear_fn', 'lstm', 'matmul']
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxapprox.modules import (ApproxConv1D, ApproxConv2d, ApproxFunctionalConv2d, ApproxFunctionalLinear,
                              ApproxLinear, ApproxLSTM, ApproxMatmul, SamplingSpec, lstm_blocker, resolve_conv_padding)
from fxapprox.ops.lstm import LSTMBackward

MATMUL_TARGETS = (torch.matmul, operator.matmul, torch.mm)
LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
CONV2D_TARGETS = (F.conv2d, torch.conv2d)
CONV2D_ARG_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV2D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}

#: layer kinds that are recognised but have no approximate version (they stay exact, with this reason)
UNSUPPORTED_MODULES: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Conv1d, "conv1d"), (nn.Conv3d, "conv3d"), (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"), (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.GRU, "gru"), (nn.RNN, "rnn"),
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


def _rows(meta: dict) -> int:
    """Rows of the layer's GEMM (batch × tokens for a linear, batch for a conv): from its output shape."""
    shape = meta.get("shape")
    if not shape or not all(isinstance(s, int) for s in shape):
        return 0
    return math.prod(shape[:-1]) if meta.get("op_kind") in ("linear", "linear_fn", "matmul", "conv1d_hf") \
        else shape[0]


def kept_count(ratio: float, n: int) -> int:
    """Pairs kept of ``n`` at keep-ratio ``ratio`` (the planner's k: floor, at least 1)."""
    return max(1, min(n, math.floor(ratio * n + 1e-9)))


class OpKind:
    """Base handler: override what the kind needs (see the module docstring)."""

    #: the ``op_kind`` written into ``node.meta["fxapprox"]``
    name: str = ""
    #: sampling modes this kind offers (see ``fxapprox.modules.MODES``)
    modes: tuple[str, ...] = ("forward", "backward", "weight_grad")
    #: methods it offers (``None``: every registered method)
    methods: tuple[str, ...] | None = None

    # -- matching ------------------------------------------------------------
    def match(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict | None:
        """Channel info (``in_channels``, ``out_channels``, ``reduction_size``, …) or ``None``."""
        raise NotImplementedError

    def blocker(self, gm: torch.fx.GraphModule, node: torch.fx.Node, meta: dict) -> str | None:
        """Why this node cannot be approximated at all, or ``None``."""
        return None

    def mode_blocker(self, meta: dict, mode: str, ratio: float, min_k: int, min_channels: int) -> str | None:
        """Why ``mode`` at keep-ratio ``ratio`` does not fit this node, or ``None``.

        Every sampled dimension must keep at least ``min_k`` entries; a sampled input
        gradient also needs ``min_channels`` output features to choose from (sampling
        2 of a classifier's 10 outputs starves every layer below of 8 classes' gradient).
        """
        if mode not in self.modes:
            return f"{mode} sampling is not offered for {self.name}"
        if mode == "weight_grad" and not meta.get("weight_requires_grad", True):
            return "frozen weight (no weight gradient to sample)"
        n = meta.get("reduction_size") or 0
        if mode == "forward":
            k = kept_count(ratio, n)
            return f"k={k} at keep-ratio {ratio:g} < min_k={min_k}" if k < min_k else None
        rows = _rows(meta)
        if round(ratio * rows) < min_k:
            return f"{round(ratio * rows)} of {rows} batch rows at keep-ratio {ratio:g} < min_k={min_k}"
        if mode == "backward":
            out = meta.get("out_channels") or 0
            if out < min_channels:
                return f"input-gradient sampling over {out} outputs < min_channels={min_channels}"
            if round(ratio * out) < min_k:
                return f"{round(ratio * out)} of {out} outputs at keep-ratio {ratio:g} < min_k={min_k}"
        return None

    # -- cost ----------------------------------------------------------------
    def weight_grad_flops(self, meta: dict) -> int:
        """FLOPs of the weight-gradient product (for these kinds: the forward product's, when it exists)."""
        return int(meta.get("flops_fwd", 0)) if meta.get("weight_requires_grad", True) else 0

    def candidate_flops(self, meta: dict, mode: str, keep_ratio: float) -> int:
        """Training FLOPs (forward + backward) of the node approximated with ``mode`` at ``keep_ratio``."""
        forward, backward = int(meta.get("flops_fwd", 0)), int(meta.get("flops_bwd", 0))
        if mode == "forward":
            sampled = forward + backward
        elif mode == "backward":
            sampled = backward
        else:
            sampled = min(backward, self.weight_grad_flops(meta))
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


def match_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[OpKind | None, dict]:
    """The registered kind of ``node`` and its channel info; ``(None, info)`` for every other node
    (``info["op_kind"]`` still names a recognised kind without an approximate version, or ``None``)."""
    for handler in _REGISTRY.values():
        info = handler.match(gm, node)
        if info is not None:
            return handler, {"op_kind": handler.name, "approximable": True, **info}
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        for module_type, kind in UNSUPPORTED_MODULES:
            if isinstance(module, module_type):
                return None, {"op_kind": kind, "module_type": type(module).__name__}
        return None, {"op_kind": None, "module_type": type(module).__name__}
    if node.op in ("call_function", "call_method") and _is_matmul(node):
        return None, {"op_kind": "matmul", "parameter_operand": False}
    if node.op == "call_function" and node.target in LINEAR_TARGETS + CONV2D_TARGETS:
        kind = "linear_fn" if node.target in LINEAR_TARGETS else "conv2d_fn"
        return None, {"op_kind": kind, "parameter_operand": False}
    return None, {"op_kind": None}


def handler_for(meta: dict) -> OpKind | None:
    """The handler of an annotated node (``None`` when no registered kind matched it: an
    activation @ activation matmul is ``op_kind="matmul"`` but not approximable)."""
    return _REGISTRY.get(meta.get("op_kind")) if meta.get("approximable") else None


def _is_matmul(node: torch.fx.Node) -> bool:
    return node.target in MATMUL_TARGETS or (node.op == "call_method" and node.target == "matmul")


def _own_forward_blocker(module: nn.Module, base: type) -> str | None:
    """A subclass that overrides ``forward`` (timm's ``ScaledStdConv2dSame`` standardises its weight and pads)
    is not the plain op: the sampled module would drop what its forward adds."""
    if type(module).forward is base.forward:
        return None
    return f"{type(module).__name__} overrides {base.__name__}.forward (not the plain op): stays exact"


# -- the kinds -------------------------------------------------------------------------------------------
class LinearKind(OpKind):
    name = "linear"

    def blocker(self, gm, node, meta):
        return _own_forward_blocker(gm.get_submodule(node.target), nn.Linear)

    def match(self, gm, node):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.Linear):
            return None
        module = gm.get_submodule(node.target)
        return {"module_type": type(module).__name__, "in_channels": module.in_features,
                "out_channels": module.out_features, "groups": 1, "reduction_size": module.in_features,
                "weight_requires_grad": module.weight.requires_grad}

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxLinear.from_linear(gm.get_submodule(node.target), spec)

    def gradient_operands(self, gm, node):
        return [], ["weight"]


class Conv2dKind(OpKind):
    name = "conv2d"

    def match(self, gm, node):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.Conv2d):
            return None
        module = gm.get_submodule(node.target)
        return {"module_type": type(module).__name__, "in_channels": module.in_channels,
                "out_channels": module.out_channels, "groups": module.groups, "reduction_size": module.in_channels,
                "kernel_size": list(module.kernel_size), "padding_mode": module.padding_mode,
                "weight_requires_grad": module.weight.requires_grad}

    def blocker(self, gm, node, meta):
        reason = _own_forward_blocker(gm.get_submodule(node.target), nn.Conv2d) or _groups_blocker(meta)
        if reason is None and resolve_conv_padding(gm.get_submodule(node.target)) is None:
            reason = "asymmetric 'same' padding (even kernel): not sampled"
        return reason

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxConv2d.from_conv2d(gm.get_submodule(node.target), spec)

    def gradient_operands(self, gm, node):
        return [], ["weight"]


def _groups_blocker(meta: dict) -> str | None:
    groups = meta.get("groups", 1)
    if groups is None:
        return "functional conv2d with traced groups: not sampled"
    if groups == meta.get("in_channels") and groups > 1:
        return "depthwise conv (groups == in_channels): one channel per group, nothing to sample"
    if groups != 1:
        return f"grouped conv (groups={groups}): channel sampling per group not supported"
    return None


class FunctionalLinearKind(OpKind):
    name = "linear_fn"

    def match(self, gm, node):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            return None
        weight = parameter_of(gm, linear_call_args(node.args, node.kwargs)[1])
        if weight is None or weight.dim() != 2:
            return None
        return {"parameter_operand": True, "in_channels": weight.shape[1], "out_channels": weight.shape[0],
                "groups": 1, "reduction_size": weight.shape[1], "parameter_side": "right",
                "weight_requires_grad": weight.requires_grad}

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxFunctionalLinear(spec)

    def call_args(self, node, args, kwargs):
        return linear_call_args(tuple(args), dict(kwargs))

    def gradient_operands(self, gm, node):
        return [1], []


class FunctionalConv2dKind(OpKind):
    name = "conv2d_fn"

    def match(self, gm, node):
        if node.op != "call_function" or node.target not in CONV2D_TARGETS:
            return None
        call = conv2d_call_args(node)
        weight = parameter_of(gm, call["weight"])
        if weight is None or weight.dim() != 4:
            return None
        groups = call["groups"] if isinstance(call["groups"], int) else None
        return {"parameter_operand": True, "in_channels": weight.shape[1] * (groups or 1),
                "out_channels": weight.shape[0], "groups": groups, "reduction_size": weight.shape[1],
                "kernel_size": list(weight.shape[2:]),
                "numeric_padding": not isinstance(call["padding"], (str, torch.fx.Node)),
                "weight_requires_grad": weight.requires_grad}

    def blocker(self, gm, node, meta):
        if not meta.get("numeric_padding", True):
            return "functional conv2d with string or traced padding: not sampled"
        return _groups_blocker(meta)

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        call = conv2d_call_args(node)
        return ApproxFunctionalConv2d(spec, call["stride"], call["padding"], call["dilation"])

    def call_args(self, node, args, kwargs):
        values = dict(CONV2D_DEFAULTS)
        values.update(zip(CONV2D_ARG_NAMES, args))
        values.update(kwargs)
        return (values["input"], values["weight"], values["bias"])

    def gradient_operands(self, gm, node):
        return [1], []


class MatmulKind(OpKind):
    name = "matmul"

    def match(self, gm, node):
        if node.op not in ("call_function", "call_method") or not _is_matmul(node):
            return None
        left, right = (list(node.args) + [None, None])[:2]
        right_param, left_param = parameter_of(gm, right), parameter_of(gm, left)
        if right_param is not None and right_param.dim() == 2 and left_param is None:
            return {"parameter_operand": True, "parameter_side": "right", "in_channels": right_param.shape[0],
                    "out_channels": right_param.shape[1], "groups": 1, "reduction_size": right_param.shape[0],
                    "weight_requires_grad": right_param.requires_grad}
        if left_param is not None and left_param.dim() == 2 and right_param is None:
            return {"parameter_operand": True, "parameter_side": "left", "in_channels": left_param.shape[1],
                    "out_channels": left_param.shape[0], "groups": 1, "reduction_size": left_param.shape[1],
                    "weight_requires_grad": left_param.requires_grad}
        return None

    def mode_blocker(self, meta, mode, ratio, min_k, min_channels):
        if mode != "forward" and meta.get("parameter_side") == "left":
            return "backward sampling of W @ x is not offered (rows are the parameter's side)"
        return super().mode_blocker(meta, mode, ratio, min_k, min_channels)

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        from fxapprox.passes._meta import fx_meta

        return ApproxMatmul(spec, fx_meta(node)["parameter_side"])

    def call_args(self, node, args, kwargs):
        return tuple(args[:2])

    def gradient_operands(self, gm, node):
        from fxapprox.passes._meta import fx_meta

        return [1 if fx_meta(node)["parameter_side"] == "right" else 0], []


class LSTMKind(OpKind):
    """``nn.LSTM``: the forward stays exact, the backward keeps the top-k gate-gradient columns per gate."""

    name = "lstm"
    modes = ("backward",)
    methods = ("topk",)

    def match(self, gm, node):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.LSTM):
            return None
        module = gm.get_submodule(node.target)
        return {"module_type": type(module).__name__, "in_channels": module.input_size,
                "out_channels": module.hidden_size, "groups": 1, "reduction_size": module.hidden_size}

    def blocker(self, gm, node, meta):
        module = gm.get_submodule(node.target)
        return _own_forward_blocker(module, nn.LSTM) or lstm_blocker(module)

    def mode_blocker(self, meta, mode, ratio, min_k, min_channels):
        if mode != "backward":
            return f"{mode} sampling is not offered for an LSTM (its forward stays exact)"
        k = kept_count(ratio, meta.get("reduction_size") or 0)
        return f"k={k} gate columns at keep-ratio {ratio:g} < min_k={min_k}" if k < min_k else None

    def candidate_flops(self, meta, mode, keep_ratio):
        forward, backward = int(meta.get("flops_fwd", 0)), int(meta.get("flops_bwd", 0))
        return round(forward + backward - (1.0 - keep_ratio) * backward)

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxLSTM.from_lstm(gm.get_submodule(node.target), spec, lstm.granularity, lstm.block_steps)

    def gradient_operands(self, gm, node):
        module = gm.get_submodule(node.target)
        return [], [name for name, _ in module.named_parameters() if name.startswith("weight")]


def hf_conv1d_class(module: nn.Module) -> type | None:
    """Hugging Face's ``Conv1D`` class if ``module`` is one (matched by class, so transformers is not imported)."""
    return next((c for c in type(module).__mro__
                 if c.__name__ == "Conv1D" and c.__module__.startswith("transformers")), None)


class HFConv1DKind(OpKind):
    """Hugging Face's ``Conv1D`` (GPT-2's projections): ``x @ W + b`` with ``W`` ``[in, out]``, a linear layer
    with the weight transposed (matched by class, so transformers is not imported)."""

    name = "conv1d_hf"

    def match(self, gm, node):
        if node.op != "call_module" or hf_conv1d_class(gm.get_submodule(node.target)) is None:
            return None
        module = gm.get_submodule(node.target)
        n_in, n_out = module.weight.shape
        return {"module_type": type(module).__name__, "in_channels": n_in, "out_channels": n_out, "groups": 1,
                "reduction_size": n_in, "weight_requires_grad": module.weight.requires_grad}

    def blocker(self, gm, node, meta):
        module = gm.get_submodule(node.target)
        return _own_forward_blocker(module, hf_conv1d_class(module))

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxConv1D.from_conv1d(gm.get_submodule(node.target), spec)

    def gradient_operands(self, gm, node):
        return [], ["weight"]


for _handler in (LinearKind(), Conv2dKind(), FunctionalLinearKind(), FunctionalConv2dKind(), MatmulKind(),
                 LSTMKind(), HFConv1DKind()):
    register_op_kind(_handler)

__all__ = ["OP_KINDS", "OpKind", "conv2d_call_args", "handler_for", "hf_conv1d_class", "kept_count",
           "linear_call_args", "match_node", "parameter_of", "register_op_kind"]
