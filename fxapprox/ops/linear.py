"""Sampled linear layer: ``y ≈ x[:, S] · W[:, S]ᵀ + b`` (forward sampling).

``x @ Wᵀ`` is a sum of ``n = in_features`` outer products, one per input
feature ("column-row pair"). Forward sampling keeps a subset ``S`` of them, so
the forward GEMM and both backward GEMMs (input and weight gradient) shrink by
``|S| / n``. The autograd Function below saves only the gathered ``x[:, S]``
and ``W[:, S]`` and writes gradients only into the kept columns; letting
autograd differentiate ``index_select`` instead costs an extra full-size
scatter per operand (measured slower than the dense layer on CPU).
"""

from __future__ import annotations

import torch

from fxapprox.ops.sampling import select_pairs


class _SampledLinearFunction(torch.autograd.Function):
    """``x2d[:, kept] @ weight[:, kept]ᵀ (· scale) + bias`` with sparse-column gradients."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, kept, scale):
        x_kept = x2d.index_select(1, kept)
        if scale is not None:
            x_kept = x_kept * scale.to(x_kept.dtype)
        w_kept = weight.index_select(1, kept)
        if bias is None:
            out = x_kept @ w_kept.t()
        else:
            out = torch.addmm(bias, x_kept, w_kept.t())
        ctx.save_for_backward(x_kept, w_kept, kept, scale)
        ctx.in_features = x2d.shape[1]
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_kept, w_kept, kept, scale = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x_kept = grad_out @ w_kept
            if scale is not None:
                grad_x_kept = grad_x_kept * scale.to(grad_x_kept.dtype)
            grad_x = grad_out.new_zeros(grad_out.shape[0], ctx.in_features)
            grad_x.index_copy_(1, kept, grad_x_kept)
        if ctx.needs_input_grad[1]:
            # x_kept already carries the scale, so dW[:, S] = dYᵀ · x_kept.
            grad_w = grad_out.new_zeros(w_kept.shape[0], ctx.in_features)
            grad_w.index_copy_(1, kept, grad_out.t() @ x_kept)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum(0)
        return grad_x, grad_w, grad_b, None, None


def pair_scores_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``‖x[:, i]‖ · ‖W[:, i]‖`` for every input feature ``i`` (fp32, no autograd)."""
    with torch.no_grad():
        x_norms = torch.linalg.vector_norm(x2d, dim=0, dtype=torch.float32)
        w_norms = torch.linalg.vector_norm(weight, dim=0, dtype=torch.float32)
        return x_norms * w_norms


def sampled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   k: int, method: str = "topk") -> torch.Tensor:
    """Approximate ``F.linear(x, weight, bias)`` keeping ``k`` of ``in_features`` pairs.

    With ``k >= in_features`` this is exactly ``F.linear``.

    Example::

        >>> x, w = torch.randn(8, 64), torch.randn(32, 64)
        >>> sampled_linear(x, w, None, k=64).allclose(x @ w.t())
        True
    """
    in_features = weight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {in_features}")
    if k >= in_features:
        return torch.nn.functional.linear(x, weight, bias)
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    lead_shape = x.shape[:-1]
    x2d = x.reshape(-1, in_features)
    kept, scale = select_pairs(method, pair_scores_linear(x2d, weight), k)
    out = _SampledLinearFunction.apply(x2d, weight, bias, kept, scale)
    return out.reshape(*lead_shape, weight.shape[0])
