"""Sampled 2-D convolution: keep ``k`` of the input channels (forward sampling).

A convolution is a sum over input channels; a "pair" is input channel ``c``,
scored by ``‖X[:, c]‖`` (over batch and space) times ``‖W[:, c]‖`` (over
output channels and kernel). The kept channels of ``X`` and ``W`` are gathered
once and a smaller dense convolution runs; the backward calls
``aten.convolution_backward`` on the gathered operands and writes gradients
only into the kept channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxapprox.ops.sampling import select_pairs


class _SampledConv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kept, scale, stride, padding, dilation):
        x_kept = x.index_select(1, kept)
        if scale is not None:
            x_kept = x_kept * scale.to(x_kept.dtype).view(1, -1, 1, 1)
        w_kept = weight.index_select(1, kept)
        out = F.conv2d(x_kept, w_kept, bias, stride, padding, dilation, 1)
        ctx.save_for_backward(x_kept, w_kept, kept, scale)
        ctx.conv_args = (stride, padding, dilation)
        ctx.in_channels = x.shape[1]
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_kept, w_kept, kept, scale = ctx.saved_tensors
        stride, padding, dilation = ctx.conv_args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.bias_sizes is not None
        grad_x_kept, grad_w_kept, grad_b = torch.ops.aten.convolution_backward(
            grad_out.contiguous(), x_kept, w_kept, ctx.bias_sizes, list(stride), list(padding),
            list(dilation), False, [0, 0], 1, [need_x, need_w, need_b])
        grad_x = grad_w = None
        if need_x:
            if scale is not None:
                grad_x_kept = grad_x_kept * scale.to(grad_x_kept.dtype).view(1, -1, 1, 1)
            n, _, h, w = grad_x_kept.shape
            grad_x = grad_x_kept.new_zeros(n, ctx.in_channels, h, w)
            grad_x.index_copy_(1, kept, grad_x_kept)
        if need_w:
            grad_w = grad_w_kept.new_zeros(w_kept.shape[0], ctx.in_channels, *w_kept.shape[2:])
            grad_w.index_copy_(1, kept, grad_w_kept)
        return grad_x, grad_w, (grad_b if need_b else None), None, None, None, None, None


def pair_scores_conv2d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``‖X[:, c]‖ · ‖W[:, c]‖`` for every input channel ``c`` (fp32, no autograd)."""
    with torch.no_grad():
        x_norms = torch.linalg.vector_norm(x, dim=(0, 2, 3), dtype=torch.float32)
        w_norms = torch.linalg.vector_norm(weight, dim=(0, 2, 3), dtype=torch.float32)
        return x_norms * w_norms


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def sampled_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   k: int, stride=1, padding=0, dilation=1, method: str = "topk") -> torch.Tensor:
    """Approximate ``F.conv2d(x, weight, bias, stride, padding, dilation)`` (groups=1).

    ``padding`` must be numeric (resolve ``"same"``/``"valid"`` before calling).
    With ``k >= in_channels`` this is exactly ``F.conv2d``.

    Example::

        >>> x, w = torch.randn(2, 16, 8, 8), torch.randn(4, 16, 3, 3)
        >>> sampled_conv2d(x, w, None, k=16, padding=1).allclose(F.conv2d(x, w, padding=1))
        True
    """
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    in_channels = weight.shape[1]
    if x.dim() != 4 or x.shape[1] != in_channels:
        raise ValueError(f"x must be (N, {in_channels}, H, W), got shape {tuple(x.shape)}")
    if k >= in_channels:
        return F.conv2d(x, weight, bias, stride, padding, dilation, 1)
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    kept, scale = select_pairs(method, pair_scores_conv2d(x, weight), k)
    return _SampledConv2dFunction.apply(x, weight, bias, kept, scale, stride, padding, dilation)
