"""Max pooling that saves its argmax as 8-bit window offsets instead of 64-bit indices.

``F.max_pool2d`` keeps, for backward, one int64 index per output element; in a
ResNet stem that is as many bytes as a 4-bit copy of every other activation of
the first stage together. The offset of the maximum inside its window
(``dh·kw + dw``, below ``kh·kw ≤ 256``) says the same thing in one byte.
Forward and backward are exact: the backward scatter-adds the gradient to the
same input positions ``max_pool2d``'s own backward does. Used by the memory
rewrite when activations are compressed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair


def _origins(out_h: int, out_w: int, stride, padding, device):
    rows = torch.arange(out_h, device=device).view(-1, 1) * stride[0] - padding[0]
    cols = torch.arange(out_w, device=device).view(1, -1) * stride[1] - padding[1]
    return rows, cols


class _CompactMaxPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode):
        outputs, offsets = [], []
        # max_pool2d's int64 index is 8 bytes per output: pool a slice of the batch at a time so only
        # one slice's index exists at once.
        outputs_per_sample = max(1, x[0].numel() // (stride[0] * stride[1]))
        step = max(1, (1 << 22) // outputs_per_sample)
        for start in range(0, x.shape[0], step):
            part = x[start:start + step]
            out, index = F.max_pool2d(part, kernel, stride, padding, 1, ceil_mode, return_indices=True)
            rows, cols = _origins(out.shape[-2], out.shape[-1], stride, padding, x.device)
            # In place on the index: offset = (row − row0)·kw + (col − col0).
            in_row = torch.div(index, part.shape[-1], rounding_mode="floor")
            index.sub_(in_row * part.shape[-1]).sub_(cols)
            offsets.append(in_row.sub_(rows).mul_(kernel[1]).add_(index).to(torch.uint8))
            outputs.append(out)
            del index, in_row
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        offset = offsets[0] if len(offsets) == 1 else torch.cat(offsets)
        ctx.save_for_backward(offset)
        ctx.geometry = (x.shape, kernel, stride, padding)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (offset,) = ctx.saved_tensors
        shape, kernel, stride, padding = ctx.geometry
        rows, cols = _origins(grad_out.shape[-2], grad_out.shape[-1], stride, padding, grad_out.device)
        lead = shape[:-2].numel()
        grad_in = grad_out.new_zeros(lead, shape[-2] * shape[-1])
        offset = offset.reshape(lead, *offset.shape[-2:])
        grad_out = grad_out.reshape(lead, -1)
        # The int64 scatter index is 8 bytes per output: build it a slice of planes at a time so
        # the backward's peak memory stays near max_pool2d's own.
        step = max(1, (1 << 22) // max(1, offset[0].numel()))
        for start in range(0, lead, step):
            part = offset[start:start + step]
            in_row = torch.div(part, kernel[1], rounding_mode="floor")
            in_col = part - in_row * kernel[1]
            index = in_row.to(torch.int64).add_(rows).mul_(shape[-1]).add_(in_col).add_(cols)
            grad_in[start:start + step].scatter_add_(1, index.view(index.shape[0], -1), grad_out[start:start + step])
        return grad_in.view(shape), None, None, None, None


def compact_max_pool2d(x: torch.Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False) -> torch.Tensor:
    """``F.max_pool2d(x, kernel_size, stride, padding, ceil_mode=ceil_mode)`` saving 1 byte per output.

    Example::

        >>> x = torch.randn(2, 8, 32, 32, requires_grad=True)
        >>> torch.equal(compact_max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))
        True
    """
    kernel = _pair(kernel_size)
    stride = kernel if stride is None or (isinstance(stride, (tuple, list)) and not stride) else _pair(stride)
    padding = _pair(padding)
    if kernel[0] * kernel[1] > 256 or x.dim() != 4 or not (torch.is_grad_enabled() and x.requires_grad):
        return F.max_pool2d(x, kernel, stride, padding, 1, ceil_mode)
    return _CompactMaxPool2d.apply(x, kernel, stride, padding, ceil_mode)


def compactable(kernel_size, dilation, return_indices: bool) -> bool:
    """Whether a max-pool call can be replaced by :func:`compact_max_pool2d`."""
    kernel = _pair(kernel_size)
    return _pair(dilation) == (1, 1) and not return_indices and kernel[0] * kernel[1] <= 256
