"""Attention whose backward rebuilds the softmax from its saved (compressed) inputs, normalised again.

``F.scaled_dot_product_attention``'s own backward recomputes the attention weights
``P = exp(q·kᵀ·s − lse)`` from the saved q and k against the log-sum-exp of the exact
forward. With q and k saved as low-bit copies that is inconsistent: an error in q times
a key component all keys share (trained keys have a large common one) shifts a whole row
of scores, and ``exp`` turns the shift into a scale of the whole row that nothing
normalises away. On the char transformer after 300 steps that made the attention inputs
the dearest values by 100× (``benchmarks/bench_planner.py``, "attention" section).

:func:`attention_from_saved_inputs` runs the same kernel forward, saves only q, k, v (and
a mask), and in backward re-runs attention on the rebuilt copies under autograd: the
weights are a softmax of the rebuilt scores, rows summing to one, and a row-wide shift
cancels. It costs one more attention forward in backward and saves the output and the
log-sum-exp the kernel would keep. Outside a compressing training forward (eval,
``no_grad``, no memory plan) it *is* ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxapprox.ops._autocast import cast_like_autocast
from fxapprox.ops.training_context import current, training_context


class _AttentionFromSavedInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, extra):
        ctx.is_causal, ctx.scale, ctx.extra = is_causal, scale, extra
        ctx.has_mask = attn_mask is not None
        ctx.save_for_backward(q, k, v, *([attn_mask] if ctx.has_mask else []))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                                              scale=scale, **extra)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *mask = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), wanted)]
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask[0] if mask else None, dropout_p=0.0,
                                                 is_causal=ctx.is_causal, scale=ctx.scale, **ctx.extra)
            needed = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(out, needed, grad) if needed else ())
        return (*(next(grads) if need else None for need in wanted), None, None, None, None)


def attention_from_saved_inputs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                **extra):
    """``F.scaled_dot_product_attention`` (same arguments; ``dropout_p`` must be 0) whose backward re-runs
    attention on the saved copies of its inputs; see the module docstring.

    Example::

        >>> out = attention_from_saved_inputs(q, k, v, is_causal=True)   # == F.scaled_dot_product_attention
    """
    if dropout_p:
        raise ValueError(f"attention_from_saved_inputs needs dropout_p=0, got {dropout_p!r}")
    context = current()
    compressing = torch.is_grad_enabled() and (context.compressor is not None or context.analysing_attention)
    mask_grad = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
    if not compressing or mask_grad:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                              is_causal=is_causal, scale=scale, **extra)
    # cast before the Function, as autocast casts SDPA's arguments: its backward re-runs attention with
    # autocast off and must see the forward's dtypes
    query, key, value, attn_mask = cast_like_autocast(query, key, value, attn_mask)
    return _AttentionFromSavedInputs.apply(query, key, value, attn_mask, is_causal, scale, extra)


def as_in_compressed_training():
    """Inside the block :func:`attention_from_saved_inputs` takes its compressed-training path (for the
    analysis passes, which run nodes outside a compressing forward)."""
    return training_context(analysing_attention=True)


__all__ = ["as_in_compressed_training", "attention_from_saved_inputs"]
