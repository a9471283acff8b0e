"""Pass 2a — FLOPs: forward and backward FLOPs of every node, measured.

Uses ``torch.utils.flop_counter.FlopCounterMode`` on each node in isolation
(see ``passes/measurement/_isolation.py``), so the backward FLOPs reflect which gradients
really exist (no input gradient for the stem conv, for instance). Writes
a :class:`~fxapprox.pipeline.records.FlopCount` under ``node.meta[FLOPS_KEY]``.

``FlopCounterMode`` has no formula for the oneDNN and cuDNN LSTM kernels that
``nn.LSTM`` runs on CPU and CUDA, nor for the oneDNN linear (``mkldnn._linear_pointwise``), nor for the CPU
flash-attention kernel ``scaled_dot_product_attention`` runs on CPU (it has the CUDA ones),
and it cannot look inside our sparse-backward LSTM's custom ops (``fxapprox::lstm_layer``);
it counts 0 for all of them, so we register their formulas here. Its ``convolution_backward`` formula counts
a grouped convolution's weight gradient as if the convolution were ungrouped (a depthwise convolution's backward
~100 times its forward); it is replaced by one that counts per group. These formulas serve every
``FlopCounterMode`` in the process, so a user's own counts agree with the plan's.
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, flop_registry, register_flop_formula

from fxapprox.passes.measurement._isolation import NodeIsolationInterpreter, run_backward
from fxapprox.pipeline.records import FLOPS_KEY, FlopCount

# cuDNN/oneDNN RNN modes: RNN_RELU, RNN_TANH, LSTM, GRU.
_GATES_BY_MODE = {0: 1, 1: 1, 2: 4, 3: 3}


def _rnn_layer_flops(input_shape, w_ih_shape, w_hh_shape) -> int:
    steps_times_batch = math.prod(input_shape[:-1])
    gate_rows = w_ih_shape[0]
    return 2 * steps_times_batch * gate_rows * (w_ih_shape[1] + w_hh_shape[1])


def _mkldnn_rnn_forward(input, weight0, weight1, *args, out_shape=None, **kwargs) -> int:
    return _rnn_layer_flops(input, weight0, weight1)


def _mkldnn_rnn_backward(input, weight1, weight2, *args, out_shape=None, **kwargs) -> int:
    # input, hidden and both weight gradients: twice the forward GEMMs.
    return 2 * _rnn_layer_flops(input, weight1, weight2)


def _onednn_linear(x_shape, *rest, out_shape=None, **kwargs) -> int:
    # Overloads: default (x, weight, bias, attr, ...) and binary (x, other, weight, bias, attr).
    weight_shape = rest[0] if isinstance(rest[2], str) else rest[1]
    return 2 * math.prod(x_shape[:-1]) * weight_shape[0] * weight_shape[1]


def _cudnn_rnn_layers_flops(input_shape, weight_shapes, weight_stride0: int) -> int:
    # cuDNN's flat weight list holds per layer and direction [w_ih, w_hh(, b_ih, b_hh)]: weight_stride0 tensors.
    steps_times_batch = input_shape[0] * input_shape[1]
    total = 0
    for start in range(0, len(weight_shapes), weight_stride0):
        w_ih, w_hh = weight_shapes[start], weight_shapes[start + 1]
        total += 2 * steps_times_batch * w_ih[0] * (w_ih[1] + w_hh[1])
    return total


def _cudnn_rnn_forward(input, weight, weight_stride0, weight_buf, hx, cx, mode, *args, out_shape=None,
                       **kwargs) -> int:
    return _cudnn_rnn_layers_flops(input, weight, weight_stride0)


def _cudnn_rnn_backward(input, weight, weight_stride0, *args, out_shape=None, **kwargs) -> int:
    # input, hidden and weight gradients: twice the forward GEMMs (as for oneDNN's kernel)
    return 2 * _cudnn_rnn_layers_flops(input, weight, weight_stride0)


def _sparse_lstm_forward(x, h0, c0, w_ih, w_hh, *options, out_shape=None, **kwargs) -> int:
    return _rnn_layer_flops(x, w_ih, w_hh)


def _sparse_lstm_backward(grad_hs, grad_h_last, grad_c_last, x, h0, c0, w_ih, w_hh, *rest, out_shape=None,
                          **kwargs) -> int:
    # The three backward GEMMs run on the kept 4k of the 4H gate columns (coarse); fine-grained masks
    # entries but keeps the GEMMs full size.
    from fxapprox.ops.sampling import rounded_count

    keep_ratio, granularity = rest[4], rest[5]
    hidden = w_hh[1]
    kept = rounded_count(keep_ratio, hidden) if granularity == "coarse" else hidden
    return 2 * _rnn_layer_flops(x, w_ih, w_hh) * kept // hidden


def _attention_flops(query_shape, key_shape, value_shape) -> int:
    # Q·Kᵀ and P·V over the query heads (grouped-query attention: fewer key/value heads, as many products)
    batch, heads, queries, head_dim = query_shape
    keys, value_dim = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (head_dim + value_dim)


def _cpu_flash_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(query, key, value)


def _cpu_flash_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    # dV, dP, dQ, dK: twice the forward products (as torch's formula for the CUDA kernels)
    return 2 * _attention_flops(query, key, value)


def _convolution_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    # The input gradient and the weight gradient each take as many multiply-adds as the forward. torch's own
    # formula counts the weight gradient of a grouped convolution as if it were ungrouped (``groups`` times too
    # many: ~100x the forward for a depthwise 3x3 over 96 channels), which made depthwise models' plans and budgets
    # wrong; on ungrouped convolutions both formulas agree (tests/passes/test_analysis.py).
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed=transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _correct_grouped_convolution_backward() -> None:
    """Replace torch's ``convolution_backward`` formula by :func:`_convolution_backward`."""
    op = torch.ops.aten.convolution_backward
    flop_registry.pop(op, None)   # register_flop_formula refuses a second formula for an op
    register_flop_formula(op)(_convolution_backward)


def _register_missing_formulas() -> None:
    """Register each formula once, for ops this torch build has (the registry is keyed by overload packet)."""
    import fxapprox.ops.lstm  # noqa: F401 — defines the fxapprox:: LSTM ops

    for namespace, name, formula in (("aten", "mkldnn_rnn_layer", _mkldnn_rnn_forward),
                                     ("aten", "mkldnn_rnn_layer_backward", _mkldnn_rnn_backward),
                                     ("aten", "_cudnn_rnn", _cudnn_rnn_forward),
                                     ("aten", "_cudnn_rnn_backward", _cudnn_rnn_backward),
                                     ("mkldnn", "_linear_pointwise", _onednn_linear),
                                     ("fxapprox", "lstm_layer", _sparse_lstm_forward),
                                     ("fxapprox", "lstm_layer_backward", _sparse_lstm_backward),
                                     ("aten", "_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention),
                                     ("aten", "_scaled_dot_product_flash_attention_for_cpu_backward",
                                      _cpu_flash_attention_backward)):
        op = getattr(getattr(torch.ops, namespace), name, None)
        if op is not None and op not in flop_registry:
            register_flop_formula(op)(formula)


_register_missing_formulas()
_correct_grouped_convolution_backward()


class FlopCountInterpreter(NodeIsolationInterpreter):
    """Measures each node's forward and backward FLOPs."""

    description = "counting FLOPs"

    def measure(self, node, run, grad_inputs) -> None:
        with FlopCounterMode(display=False) as forward_counter:
            outputs = run()
        with FlopCounterMode(display=False) as backward_counter:
            run_backward(outputs, grad_inputs)
        node.meta[FLOPS_KEY] = FlopCount(int(forward_counter.get_total_flops()),
                                         int(backward_counter.get_total_flops()))


def count_flops(gm: torch.fx.GraphModule, *example_inputs, progress: bool = False) -> torch.fx.GraphModule:
    """Annotate every node with ``flops_fwd`` / ``flops_bwd`` for one training step.

    Example::

        >>> count_flops(gm, torch.randn(8, 3, 64, 64))
        >>> sum(flops_of(n).forward for n in gm.graph.nodes)
    """
    for node in gm.graph.nodes:
        node.meta[FLOPS_KEY] = FlopCount()
    FlopCountInterpreter(gm, progress=progress).run(*example_inputs)
    return gm
