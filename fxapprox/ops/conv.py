"""Sampled 2-D convolutions (groups=1): a convolution is a sum over input channels.

**Forward sampling** (:func:`sampled_conv2d`): a "pair" is input channel ``c``,
scored by ``‖X[:, c]‖`` (over batch and space) times ``‖W[:, c]‖`` (over output
channels and kernel). The kept channels of ``X`` and ``W`` are gathered once,
a smaller dense convolution runs, and the backward calls
``aten.convolution_backward`` on the gathered operands, writing gradients only
into the kept channels.

**Backward sampling** (:func:`backward_sampled_conv2d`): the forward is exact;
``dX`` keeps the strongest output channels (``‖dY[:, j]‖·‖W[j]‖``) and ``dW``
the strongest batch examples (``‖X_b‖·‖dY_b‖``). **Weight-gradient sampling**
(``sample_input_grad=False``) samples only ``dW`` and keeps ``dX`` exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxapprox.ops._autocast import cast_like_autocast
from fxapprox._validate import check_choice
from fxapprox.ops.linear import (INPUT_SAVING, _nonempty, _scaled, kept_input, pair_scores,
                                 save_sampled_operands, squared_norms)
from fxapprox.ops.sampling import rounded_count, select_pairs


def _conv_backward(grad_out, x, weight, bias_sizes, conv_args, mask):
    stride, padding, dilation = conv_args
    return torch.ops.aten.convolution_backward(
        grad_out, x, weight, bias_sizes, list(stride), list(padding), list(dilation), False, [0, 0], 1, mask)


class _SampledConv2dFunction(torch.autograd.Function):
    """A convolution over the kept input channels; saves ``weight`` itself and ``x`` itself (``keep_input``)
    or its kept channels, as :class:`fxapprox.ops.linear._SampledLinearFunction` does."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept, scale, stride, padding, dilation, keep_input):
        x_kept = _scaled(x.index_select(1, kept), scale, 1)
        out = F.conv2d(x_kept, weight.index_select(1, kept), bias, stride, padding, dilation, 1)
        save_sampled_operands(ctx, x, x_kept, weight, kept, scale, keep_input)
        ctx.conv_args = (stride, padding, dilation)
        ctx.in_channels = x.shape[1]
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, weight, kept, scale = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.bias_sizes is not None
        x_kept = kept_input(ctx, x_saved, kept, scale)
        w_kept = weight.index_select(1, kept)
        grad_x_kept, grad_w_kept, grad_b = _conv_backward(
            grad_out.contiguous(), x_kept, w_kept, ctx.bias_sizes, ctx.conv_args, [need_x, need_w, need_b])
        grad_x = grad_w = None
        if need_x:
            n, _, h, w = grad_x_kept.shape
            grad_x = grad_x_kept.new_zeros(n, ctx.in_channels, h, w)
            grad_x.index_copy_(1, kept, _scaled(grad_x_kept, scale, 1))
        if need_w:
            grad_w = grad_w_kept.new_zeros(w_kept.shape[0], ctx.in_channels, *w_kept.shape[2:])
            grad_w.index_copy_(1, kept, grad_w_kept)
        return grad_x, grad_w, (grad_b if need_b else None), None, None, None, None, None, None


def channel_squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{n,h,w} x²`` per channel of an NCHW tensor, in fp32.

    For a contiguous tensor the reduction runs over the contiguous ``H·W`` rows
    first and then over the batch: on CPU that is ~2.5× faster than one
    reduction over dims (0, 2, 3) (measured on 16×256×40×40).
    """
    if x.is_contiguous() and x.numel():
        rows = torch.linalg.vector_norm(x.flatten(2), dim=2, dtype=torch.float32)
        return rows.square_().sum(0)
    return squared_norms(x, (0, 2, 3))


def pair_scores_conv2d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``‖X[:, c]‖ · ‖W[:, c]‖`` for every input channel ``c`` (fp32, no autograd)."""
    with torch.no_grad():
        return pair_scores(channel_squared_norms(x), squared_norms(weight, (0, 2, 3)))


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    in_channels = weight.shape[1]
    if x.dim() != 4 or x.shape[1] != in_channels:
        raise ValueError(f"x must be (N, {in_channels}, H, W), got shape {tuple(x.shape)}")
    return in_channels


def sampled_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                   stride=1, padding=0, dilation=1, method: str = "topk", random_share: float = 0.0,
                   save_input: str = "reference") -> torch.Tensor:
    """Approximate ``F.conv2d(x, weight, bias, stride, padding, dilation)`` keeping ``k`` input channels.

    ``padding`` must be numeric (resolve ``"same"``/``"valid"`` before calling).
    With ``k >= in_channels`` this is exactly ``F.conv2d``. ``save_input`` as in
    :func:`fxapprox.ops.linear.sampled_linear`.

    Example::

        >>> x, w = torch.randn(2, 16, 8, 8), torch.randn(4, 16, 3, 3)
        >>> sampled_conv2d(x, w, None, k=16, padding=1).allclose(F.conv2d(x, w, padding=1))
        True
    """
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    in_channels = _check(x, weight)
    if k >= in_channels:
        return F.conv2d(x, weight, bias, stride, padding, dilation, 1)
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    x, weight, bias = cast_like_autocast(x, weight, bias)
    scores = pair_scores_conv2d(x, weight)
    kept, scale = _nonempty(*select_pairs(method, scores, k, random_share), scores)
    return conv2d_with_channels(x, weight, bias, kept, scale, stride, padding, dilation, save_input)


def conv2d_with_channels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kept: torch.Tensor,
                         scale: torch.Tensor | None, stride=1, padding=0, dilation=1,
                         save_input: str = "reference") -> torch.Tensor:
    """Forward-sampled ``F.conv2d`` on input channels chosen by the caller (``kept`` sorted)."""
    _check(x, weight)
    check_choice("save_input", save_input, INPUT_SAVING)
    x, weight, bias = cast_like_autocast(x, weight, bias)
    return _SampledConv2dFunction.apply(x, weight, bias, kept, scale, _pair(stride), _pair(padding), _pair(dilation),
                                        save_input == "reference")


class _BackwardSampledConv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, conv_args, keep_ratio, method, random_share, sample_input_grad):
        out = F.conv2d(x, weight, bias, *conv_args, 1)
        ctx.save_for_backward(x, weight)
        ctx.options = (conv_args, keep_ratio, method, random_share, sample_input_grad)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        conv_args, keep_ratio, method, random_share, sample_input_grad = ctx.options
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        grad_x = grad_w = grad_b = None
        with torch.no_grad():
            if need_x and not sample_input_grad:
                grad_x = _conv_backward(grad_out, x, weight, None, conv_args, [True, False, False])[0]
            elif need_x:
                scores = pair_scores(channel_squared_norms(grad_out), squared_norms(weight, (1, 2, 3)))
                kept, scale = _nonempty(*select_pairs(method, scores, rounded_count(keep_ratio, weight.shape[0]),
                                                      random_share), scores)
                grad_x = _conv_backward(_scaled(grad_out.index_select(1, kept), scale, 1), x,
                                        weight.index_select(0, kept), None, conv_args, [True, False, False])[0]
            if need_w:
                batch = x.shape[0]
                if batch == 0:
                    grad_w = torch.zeros_like(weight)
                else:
                    scores = pair_scores(squared_norms(x, (1, 2, 3)), squared_norms(grad_out, (1, 2, 3)))
                    kept, scale = _nonempty(*select_pairs(method, scores, rounded_count(keep_ratio, batch),
                                                          random_share), scores)
                    grad_w = _conv_backward(_scaled(grad_out.index_select(0, kept), scale, 0),
                                            x.index_select(0, kept), weight, None, conv_args,
                                            [False, True, False])[1]
            if need_b and ctx.bias_sizes is not None:
                grad_b = grad_out.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None, None, None, None, None


def backward_sampled_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep_ratio: float,
                            stride=1, padding=0, dilation=1, method: str = "topk",
                            random_share: float = 0.0, sample_input_grad: bool = True) -> torch.Tensor:
    """``F.conv2d`` exactly, with ``dX`` over kept output channels and ``dW`` over kept examples.

    ``sample_input_grad=False`` keeps ``dX`` exact (weight-gradient sampling).

    Example::

        >>> y = backward_sampled_conv2d(x, w, None, keep_ratio=0.5, padding=1)  # y == F.conv2d(x, w, padding=1)
    """
    conv_args = (_pair(stride), _pair(padding), _pair(dilation))
    _check(x, weight)
    if keep_ratio >= 1.0:
        return F.conv2d(x, weight, bias, *conv_args, 1)
    if not keep_ratio > 0.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    x, weight, bias = cast_like_autocast(x, weight, bias)
    return _BackwardSampledConv2dFunction.apply(x, weight, bias, conv_args, keep_ratio, method, random_share,
                                                sample_input_grad)
