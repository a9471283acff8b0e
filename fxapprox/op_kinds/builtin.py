"""The built-in approximable op kinds: ``nn.Linear``, ``nn.Conv2d``, ``F.linear`` and ``F.conv2d`` calls, matmuls
with a parameter operand, ``nn.LSTM`` and Hugging Face's ``Conv1D``; each one
:class:`~fxapprox.op_kinds.registry.OpKind`, registered by :func:`register_builtin_op_kinds` (called by the package,
``fxapprox/op_kinds/__init__.py``; see :mod:`fxapprox.op_kinds.registry`).
"""

from __future__ import annotations

import torch.fx
from torch import nn

from fxapprox.op_kinds.registry import (CONV2D_ARG_NAMES, CONV2D_DEFAULTS, CONV2D_TARGETS, LINEAR_TARGETS, OpKind,
                                        conv2d_call_args, is_matmul, kept_count, leading_rows, linear_call_args,
                                        parameter_of, register_op_kind)
from fxapprox.ops.lstm import LSTMBackward
from fxapprox.pipeline.records import flops_of, kind_of
from fxapprox.runtime.modules import (ApproxConv1D, ApproxConv2d, ApproxFunctionalConv2d, ApproxFunctionalLinear,
                                      ApproxLinear, ApproxLSTM, ApproxMatmul, lstm_blocker, resolve_conv_padding)

__all__ = ["Conv2dKind", "FunctionalConv2dKind", "FunctionalLinearKind", "HFConv1DKind", "LSTMKind", "LinearKind",
           "MatmulKind", "hf_conv1d_class", "register_builtin_op_kinds"]


def _own_forward_blocker(module: nn.Module, base: type) -> str | None:
    """A subclass that overrides ``forward`` (timm's ``ScaledStdConv2dSame`` standardises its weight and pads)
    is not the plain op: the sampled module would drop what its forward adds."""
    if type(module).forward is base.forward:
        return None
    return f"{type(module).__name__} overrides {base.__name__}.forward (not the plain op): stays exact"


# -- the kinds -------------------------------------------------------------------------------------------
class LinearKind(OpKind):
    name = "linear"

    def batch_rows(self, node):
        return leading_rows(node)

    def blocker(self, gm, node):
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

    def blocker(self, gm, node):
        reason = _own_forward_blocker(gm.get_submodule(node.target), nn.Conv2d) or _groups_blocker(node)
        if reason is None and resolve_conv_padding(gm.get_submodule(node.target)) is None:
            reason = "asymmetric 'same' padding (even kernel): not sampled"
        return reason

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxConv2d.from_conv2d(gm.get_submodule(node.target), spec)

    def gradient_operands(self, gm, node):
        return [], ["weight"]


def _groups_blocker(node: torch.fx.Node) -> str | None:
    kind = kind_of(node)
    groups = kind.groups
    if groups is None:
        return "functional conv2d with traced groups: not sampled"
    if groups == kind.in_channels and groups > 1:
        return "depthwise conv (groups == in_channels): one channel per group, nothing to sample"
    if groups != 1:
        return f"grouped conv (groups={groups}): channel sampling per group not supported"
    return None


class FunctionalLinearKind(OpKind):
    name = "linear_fn"

    def batch_rows(self, node):
        return leading_rows(node)

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

    def blocker(self, gm, node):
        if not kind_of(node).numeric_padding:
            return "functional conv2d with string or traced padding: not sampled"
        return _groups_blocker(node)

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

    def batch_rows(self, node):
        return leading_rows(node)

    def match(self, gm, node):
        if node.op not in ("call_function", "call_method") or not is_matmul(node):
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

    def mode_blocker(self, node, mode, ratio, min_k, min_channels):
        if mode != "forward" and kind_of(node).parameter_side == "left":
            return "backward sampling of W @ x is not offered (rows are the parameter's side)"
        return super().mode_blocker(node, mode, ratio, min_k, min_channels)

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxMatmul(spec, kind_of(node).parameter_side)

    def call_args(self, node, args, kwargs):
        return tuple(args[:2])

    def gradient_operands(self, gm, node):
        return [1 if kind_of(node).parameter_side == "right" else 0], []


class LSTMKind(OpKind):
    """``nn.LSTM``: the forward stays exact, the backward keeps the top-k gate-gradient columns per gate."""

    name = "lstm"
    modes = ("backward",)
    methods = ("topk",)
    uses_random_share = False

    def match(self, gm, node):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), nn.LSTM):
            return None
        module = gm.get_submodule(node.target)
        return {"module_type": type(module).__name__, "in_channels": module.input_size,
                "out_channels": module.hidden_size, "groups": 1, "reduction_size": module.hidden_size}

    def blocker(self, gm, node):
        module = gm.get_submodule(node.target)
        return _own_forward_blocker(module, nn.LSTM) or lstm_blocker(module)

    def mode_blocker(self, node, mode, ratio, min_k, min_channels):
        if mode != "backward":
            return f"{mode} sampling is not offered for an LSTM (its forward stays exact)"
        k = kept_count(ratio, kind_of(node).reduction_size or 0)
        return f"k={k} gate columns at keep-ratio {ratio:g} < min_k={min_k}" if k < min_k else None

    def candidate_flops(self, node, mode, keep_ratio):
        forward, backward = flops_of(node).forward, flops_of(node).backward
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

    def batch_rows(self, node):
        return leading_rows(node)

    def match(self, gm, node):
        if node.op != "call_module" or hf_conv1d_class(gm.get_submodule(node.target)) is None:
            return None
        module = gm.get_submodule(node.target)
        n_in, n_out = module.weight.shape
        return {"module_type": type(module).__name__, "in_channels": n_in, "out_channels": n_out, "groups": 1,
                "reduction_size": n_in, "weight_requires_grad": module.weight.requires_grad}

    def blocker(self, gm, node):
        module = gm.get_submodule(node.target)
        return _own_forward_blocker(module, hf_conv1d_class(module))

    def build(self, gm, node, spec, lstm=LSTMBackward()):
        return ApproxConv1D.from_conv1d(gm.get_submodule(node.target), spec)

    def gradient_operands(self, gm, node):
        return [], ["weight"]


def register_builtin_op_kinds() -> None:
    """Register the built-in kinds (called once, by ``fxapprox/op_kinds/__init__.py``)."""
    for handler in (LinearKind(), Conv2dKind(), FunctionalLinearKind(), FunctionalConv2dKind(), MatmulKind(),
                    LSTMKind(), HFConv1DKind()):
        register_op_kind(handler)
