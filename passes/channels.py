"""Pass 2d — layer kinds and channels: what each node computes and over how many pairs.

A pure graph pass (no execution). For every node it writes ``op_kind``
(``"linear"``, ``"conv2d"``, ``"matmul"``, ``"lstm"``, … or ``None``),
``in_channels``, ``out_channels``, ``groups``, ``reduction_size`` (the number
of column-row pairs a sampled version chooses from) and, for functional
ops, ``parameter_operand`` / ``parameter_side``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxapprox.passes._meta import fx_meta

MATMUL_TARGETS = (torch.matmul, operator.matmul, torch.mm)
LINEAR_TARGETS = (F.linear, torch._C._nn.linear)
CONV2D_TARGETS = (F.conv2d, torch.conv2d)
CONV2D_ARG_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV2D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def conv2d_call_args(node: torch.fx.Node) -> dict:
    """The arguments of a ``F.conv2d`` call node by name, defaults filled in."""
    values = dict(CONV2D_DEFAULTS)
    values.update(zip(CONV2D_ARG_NAMES, node.args))
    values.update(node.kwargs)
    return values

_MODULE_KINDS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.LSTM, "lstm"),
    (nn.GRU, "gru"),
    (nn.RNN, "rnn"),
)


def _parameter_of(gm: torch.fx.GraphModule, arg) -> nn.Parameter | None:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = gm
        for part in arg.target.split("."):
            value = getattr(value, part, None)
        if isinstance(value, nn.Parameter):
            return value
    return None


def _module_info(module: nn.Module) -> dict:
    for module_type, kind in _MODULE_KINDS:
        if isinstance(module, module_type):
            break
    else:
        return {"op_kind": None, "module_type": type(module).__name__}
    info = {"op_kind": kind, "module_type": type(module).__name__}
    if isinstance(module, nn.Linear):
        info.update(in_channels=module.in_features, out_channels=module.out_features, groups=1,
                    reduction_size=module.in_features)
    elif isinstance(module, nn.modules.conv._ConvNd):
        info.update(in_channels=module.in_channels, out_channels=module.out_channels,
                    groups=module.groups, reduction_size=module.in_channels,
                    kernel_size=list(module.kernel_size), padding_mode=module.padding_mode)
    else:  # recurrent
        info.update(in_channels=module.input_size, out_channels=module.hidden_size, groups=1,
                    reduction_size=module.hidden_size)
    return info


def _function_info(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict:
    if node.target in LINEAR_TARGETS:
        weight_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        weight = _parameter_of(gm, weight_arg)
        info = {"op_kind": "linear_fn", "parameter_operand": weight is not None}
        if weight is not None and weight.dim() == 2:
            info.update(in_channels=weight.shape[1], out_channels=weight.shape[0], groups=1,
                        reduction_size=weight.shape[1], parameter_side="right")
        return info
    if node.target in CONV2D_TARGETS:
        call = conv2d_call_args(node)
        weight = _parameter_of(gm, call["weight"])
        info = {"op_kind": "conv2d_fn", "parameter_operand": weight is not None}
        if weight is not None and weight.dim() == 4:
            groups = call["groups"] if isinstance(call["groups"], int) else None
            info.update(in_channels=weight.shape[1] * (groups or 1), out_channels=weight.shape[0], groups=groups,
                        reduction_size=weight.shape[1], kernel_size=list(weight.shape[2:]),
                        numeric_padding=not isinstance(call["padding"], (str, torch.fx.Node)))
        return info
    if node.target in MATMUL_TARGETS or (node.op == "call_method" and node.target == "matmul"):
        left, right = (list(node.args) + [None, None])[:2]
        info = {"op_kind": "matmul", "parameter_operand": False}
        right_param, left_param = _parameter_of(gm, right), _parameter_of(gm, left)
        if right_param is not None and right_param.dim() == 2 and left_param is None:
            info.update(parameter_operand=True, parameter_side="right", in_channels=right_param.shape[0],
                        out_channels=right_param.shape[1], groups=1, reduction_size=right_param.shape[0])
        elif left_param is not None and left_param.dim() == 2 and right_param is None:
            info.update(parameter_operand=True, parameter_side="left", in_channels=left_param.shape[1],
                        out_channels=left_param.shape[0], groups=1, reduction_size=left_param.shape[1])
        return info
    return {"op_kind": None}


def annotate_channels(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write ``op_kind``, channels and ``reduction_size`` for every node.

    Example::

        >>> annotate_channels(gm)
        >>> gm.graph.find_nodes(op="call_module", target="fc")[0].meta["fxapprox"]["op_kind"]
        'linear'
    """
    for node in gm.graph.nodes:
        if node.op == "call_module":
            info = _module_info(gm.get_submodule(node.target))
        elif node.op in ("call_function", "call_method"):
            info = _function_info(gm, node)
        else:
            info = {"op_kind": None}
        fx_meta(node).update(info)
    return gm
