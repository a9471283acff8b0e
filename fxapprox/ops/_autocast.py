"""What ``torch.autocast`` does to the inputs of the aten op an approximate op stands in for.

Autocast casts the arguments of ops on its lower-precision list (``linear``, ``conv2d``,
``matmul``, ``lstm``, ``scaled_dot_product_attention``) inside the dispatcher, but an
``autograd.Function`` is opaque to it: ops *inside* its forward are cast one by one
(the sampled GEMM would come out bf16 while the saved operands stay fp32) and its
backward runs with autocast off, where the two dtypes meet in one GEMM and fail. So
each approximate op casts its floating inputs *before* its Function, as autocast
would for the op it replaces: the Function sees one dtype forward and backward, saves
low-precision copies (as the exact op does under autocast), and the casts, recorded
by autograd, hand the gradients back in the parameters' own dtype.
"""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``device_type`` now, or ``None`` when it is off there."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_like_autocast(*tensors):
    """``tensors`` cast as autocast casts a lower-precision op's arguments: floating tensors other than
    fp64 go to the autocast dtype of their device; ``None``, integer and fp64 tensors pass through.
    Outside autocast the tensors come back as they are.

    Example::

        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     x, w = cast_like_autocast(torch.randn(2, 3), torch.randn(4, 3))
        >>> x.dtype, w.dtype
        (torch.bfloat16, torch.bfloat16)
    """
    device = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)
    dtype = None if device is None else autocast_dtype(device)
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)
