"""Capture — torch's own transformer modules, traced through their training computation.

torch.fx keeps every ``torch.nn`` module whole (a leaf), and the forwards of ``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder`` and ``nn.Transformer`` branch on their inputs (mask dtypes,
``src.dim()``, the inference fast path), so they do not trace either. Their *training* computation is torch's slow
path, which is plain: mask checks, the in-projection (one ``F.linear`` on the packed weight for self-attention),
attention, the out-projection module, the feed-forward modules. :func:`training_forward` gives, for a module of
those types, that computation written so that torch.fx traces it — the projections and feed-forward layers become
ordinary nodes of the plan — with everything that looks at the inputs' values, dtypes or ranks in functions
``torch.fx.wrap`` keeps whole (``_canonical_mask``, ``_causal_hint``, ``sdpa_mask`` …); attention itself is a
traced ``F.scaled_dot_product_attention`` node (with its weights asked for, ``weighted_attention``).
``nn.TransformerDecoder`` and ``nn.TransformerDecoderLayer`` need only the first. Each reproduces torch's slow path op for op, so a plan that
samples nothing computes torch's training forward bit for bit — except that a batch-first module's projections
keep the samples as their first dimension (the row family samples them), so their weight gradients sum the same
products in another order (equal to rounding).

Evaluation is torch's own forward, fast path included: :func:`~fxapprox.passes.capture.trace.trace` also traces
the model with these modules whole, and the approximated model evaluates through that graph
(:class:`fxapprox.runtime.model_state.ExactEval`).

A module whose type overrides ``forward`` (a user's subclass) or uses what the slow path handles outside the
projections (``add_bias_kv``, ``add_zero_attn``) stays whole, and :func:`kept_whole_reason` says why.
"""

from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["TORCH_TRANSFORMER_TYPES", "kept_whole_reason", "training_forward"]

#: the torch modules traced through their training computation
TORCH_TRANSFORMER_TYPES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
    nn.TransformerDecoder, nn.Transformer)


# -- what looks at the inputs' values, dtypes and ranks: kept whole by torch.fx (torch.fx.wrap) ----------------
def _canonical_mask(mask, name, other, other_name, like, check_other=True):
    """torch's ``F._canonical_mask`` (a boolean mask becomes ``-inf``/0 of ``like``'s dtype), ``other``'s dtype taken
    from the tensor itself."""
    return F._canonical_mask(mask=mask, mask_name=name, other_type=F._none_or_dtype(other), other_name=other_name,
                             target_type=like.dtype, check_other=check_other)


def _causal_hint(mask, is_causal, src, batch_first):
    """``TransformerEncoder`` / ``TransformerDecoder``'s ``_detect_is_causal_mask`` on ``src``'s sequence length
    (a comparison of the mask's values)."""
    from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len
    return _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))


def _check_transformer_inputs(src, tgt, batch_first, d_model):
    """``nn.Transformer.forward``'s checks of ``src`` and ``tgt``."""
    is_batched = src.dim() == 3
    batch_dim = 0 if batch_first else 1
    if is_batched and src.size(batch_dim) != tgt.size(batch_dim):
        raise RuntimeError("the batch number of src and tgt must be equal")
    if src.size(-1) != d_model or tgt.size(-1) != d_model:
        raise RuntimeError("the feature number of src and tgt must be equal to d_model")
    return src


def _batched(x):
    """``x``, checked to be a batched (3-D) input: the only kind traced through."""
    if x.dim() != 3:
        raise ValueError(f"fxapprox traces nn.MultiheadAttention for batched (3-D) inputs; got a {x.dim()}-D "
                         "input in a training step. Add a batch dimension, or keep the module whole with "
                         "ApproxConfig(leaf_modules=(<its path>,)) (it then trains exactly).")
    return x


def _split_packed(proj, parts, embed_dim):
    """``F._in_projection_packed``'s split of a packed projection into ``parts`` tensors."""
    proj = proj.unflatten(-1, (parts, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    return tuple(proj[i] for i in range(parts))


def _merged_mask(q, k, query, key_padding_mask, attn_mask, need_weights, is_causal, num_heads, batch_first):
    """``nn.MultiheadAttention.forward`` + ``F.multi_head_attention_forward`` between the in-projection and
    attention: the masks canonicalised, checked and merged into one (N·H or 1, L, S) mask, and the causal hint.
    ``q``, ``k``: the projections, (L, N, E) or, with ``batch_first``, (N, L, E) — kept so, that every linear layer
    of a batch-first module sees the samples as its first dimension (the row family samples them); ``query``: the
    module's input (the masks take its dtype). Returns ``(attn_mask, is_causal, (N, L, S, head_dim))``."""
    key_padding_mask = _canonical_mask(key_padding_mask, "key_padding_mask", attn_mask, "attn_mask", query)
    attn_mask = _canonical_mask(attn_mask, "attn_mask", None, "", query, check_other=False)
    if batch_first:
        bsz, tgt_len, embed_dim = q.shape
        src_len = k.shape[1]
    else:
        tgt_len, bsz, embed_dim = q.shape
        src_len = k.shape[0]
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    elif key_padding_mask is not None:
        is_causal = False
    head_dim = embed_dim // num_heads
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, src_len)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(bsz * num_heads, tgt_len, src_len)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            raise AssertionError(f"Expected key_padding_mask of shape {(bsz, src_len)}, but got "
                                 f"{tuple(key_padding_mask.shape)}")
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                            .reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    return attn_mask, is_causal, (bsz, tgt_len, src_len, head_dim)


def sdpa_mask(q, k, query, key_padding_mask, attn_mask, is_causal, num_heads, batch_first):
    """The ``attn_mask`` and ``is_causal`` arguments of ``F.scaled_dot_product_attention`` for the projections
    (``need_weights=False``): the masks canonicalised, checked, merged and shaped (N, H, L, S). The heads are
    views of the projections and attention a ``F.scaled_dot_product_attention`` node, both traced, so the memory
    plan sees what attention saves as for any model."""
    attn_mask, is_causal, (bsz, _, src_len, _) = _merged_mask(q, k, query, key_padding_mask, attn_mask, False,
                                                              is_causal, num_heads, batch_first)
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    return attn_mask, is_causal


def _sdpa_heads(x, num_heads, head_dim, batch_first):
    """A projection as (N, H, L, head_dim) — views, in ``F.multi_head_attention_forward``'s way for a
    sequence-first one."""
    if batch_first:
        return x.view(x.size(0), x.size(1), num_heads, head_dim).transpose(1, 2)
    return x.view(x.size(0), -1, head_dim).transpose(0, 1).view(x.size(1), num_heads, x.size(0), head_dim)


def weighted_attention(q, k, v, query, key_padding_mask, attn_mask, average_attn_weights, is_causal, num_heads,
                       dropout_p, training, batch_first):
    """Attention with its weights asked for (``need_weights=True``): torch's explicit softmax, as (L·N, E) rows in
    the projections' order, and the weights."""
    attn_mask, is_causal, (bsz, tgt_len, src_len, head_dim) = _merged_mask(
        q, k, query, key_padding_mask, attn_mask, True, is_causal, num_heads, batch_first)
    q, k, v = (_sdpa_heads(x, num_heads, head_dim, batch_first).flatten(0, 1) for x in (q, k, v))   # (N·H, L, d)
    if not training:
        dropout_p = 0.0
    q_scaled = q * math.sqrt(1.0 / float(head_dim))
    if is_causal and attn_mask is None:
        raise AssertionError("FIXME: is_causal not implemented for need_weights")
    if attn_mask is not None:
        weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
    else:
        weights = torch.bmm(q_scaled, k.transpose(-2, -1))
    weights = F.softmax(weights, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    output = torch.bmm(weights, v).view(bsz, num_heads, tgt_len, head_dim)
    weights = weights.view(bsz, num_heads, tgt_len, src_len)
    if average_attn_weights:
        weights = weights.mean(dim=1)
    return output.permute(*_ROW_ORDER[batch_first]).reshape(bsz * tgt_len, num_heads * head_dim), weights


#: the permutation of attention's (N, H, L, head_dim) output into the projections' row order
_ROW_ORDER = {True: (0, 2, 1, 3), False: (2, 0, 1, 3)}


for _name in ("_canonical_mask", "_causal_hint", "_check_transformer_inputs", "_batched", "sdpa_mask",
              "weighted_attention"):
    torch.fx.wrap(_name)


# -- the training computations --------------------------------------------------------------------------------
def _in_projection(mha: nn.MultiheadAttention, query, key, value):
    """The in-projection: packed (one ``F.linear`` for self-attention, two for encoder–decoder attention, three
    otherwise) or separate weights — ``F._in_projection_packed`` / ``F._in_projection``'s ops."""
    embed_dim = mha.embed_dim
    weight, bias = mha.in_proj_weight, mha.in_proj_bias
    if not mha._qkv_same_embed_dim:
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.chunk(3)
        return (F.linear(query, mha.q_proj_weight, b_q), F.linear(key, mha.k_proj_weight, b_k),
                F.linear(value, mha.v_proj_weight, b_v))
    if key is value and query is key:
        return _split_packed(F.linear(query, weight, bias), 3, embed_dim)
    if key is value:
        w_q, w_kv = weight.split([embed_dim, embed_dim * 2])
        b_q, b_kv = (None, None) if bias is None else bias.split([embed_dim, embed_dim * 2])
        return (F.linear(query, w_q, b_q),) + _split_packed(F.linear(key, w_kv, b_kv), 2, embed_dim)
    w_q, w_k, w_v = weight.chunk(3)
    b_q, b_k, b_v = (None, None, None) if bias is None else bias.chunk(3)
    return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


def multihead_attention_forward(mha: nn.MultiheadAttention, query, key, value, key_padding_mask=None,
                                need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
    """``nn.MultiheadAttention.forward``'s training computation (batched inputs, in the module's layout)."""
    same_kv, same_qk = key is value, query is key
    query_in = query
    query = _batched(query)
    key = query if same_qk and same_kv else _batched(key)
    value = key if same_kv else _batched(value)
    q, k, v = _in_projection(mha, query, key, value)
    if need_weights is False:
        mask, causal = sdpa_mask(q, k, query_in, key_padding_mask, attn_mask, is_causal, mha.num_heads,
                                 mha.batch_first)
        head_dim = mha.embed_dim // mha.num_heads
        q, k, v = (_sdpa_heads(x, mha.num_heads, head_dim, mha.batch_first) for x in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, mask, mha.dropout if mha.training else 0.0, causal)
        attended = attended.permute(*_ROW_ORDER[mha.batch_first]).reshape(-1, mha.embed_dim)
        weights = None
    else:
        attended, weights = weighted_attention(q, k, v, query_in, key_padding_mask, attn_mask, average_attn_weights,
                                               is_causal, mha.num_heads, mha.dropout, mha.training, mha.batch_first)
    output = mha.out_proj(attended)
    return output.view(query.size(0), query.size(1), output.size(1)), weights


def encoder_layer_forward(layer: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None,
                          is_causal=False):
    """``nn.TransformerEncoderLayer.forward``'s training computation (its slow path)."""
    if src_key_padding_mask is not None:
        src_key_padding_mask = _canonical_mask(src_key_padding_mask, "src_key_padding_mask", src_mask, "src_mask",
                                               src)
    if src_mask is not None:
        src_mask = _canonical_mask(src_mask, "src_mask", None, "", src, check_other=False)
    x = src
    if layer.norm_first:
        x = x + layer._sa_block(layer.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + layer._ff_block(layer.norm2(x))
    x = layer.norm1(x + layer._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return layer.norm2(x + layer._ff_block(x))


def encoder_forward(encoder: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """``nn.TransformerEncoder.forward``'s training computation (no nested tensors)."""
    if src_key_padding_mask is not None:
        src_key_padding_mask = _canonical_mask(src_key_padding_mask, "src_key_padding_mask", mask, "mask", src)
    if mask is not None:
        mask = _canonical_mask(mask, "mask", None, "", src, check_other=False)
        is_causal = _causal_hint(mask, is_causal, src, encoder.layers[0].self_attn.batch_first)
    else:
        is_causal = is_causal is True
    output = src
    for layer in encoder.layers:
        output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
    return output if encoder.norm is None else encoder.norm(output)


def decoder_forward(decoder: nn.TransformerDecoder, tgt, memory, tgt_mask=None, memory_mask=None,
                    tgt_key_padding_mask=None, memory_key_padding_mask=None, tgt_is_causal=None,
                    memory_is_causal=False):
    """``nn.TransformerDecoder.forward``'s computation (its layers' own forward traces)."""
    if tgt_mask is not None:
        tgt_is_causal = _causal_hint(tgt_mask, tgt_is_causal, tgt, decoder.layers[0].self_attn.batch_first)
    else:
        tgt_is_causal = tgt_is_causal is True
    output = tgt
    for layer in decoder.layers:
        output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                       tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                       tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
    return output if decoder.norm is None else decoder.norm(output)


def transformer_forward(transformer: nn.Transformer, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                        src_key_padding_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
                        src_is_causal=None, tgt_is_causal=None, memory_is_causal=False):
    """``nn.Transformer.forward``'s computation (its checks kept whole)."""
    src = _check_transformer_inputs(src, tgt, transformer.batch_first, transformer.d_model)
    memory = transformer.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                 is_causal=src_is_causal)
    return transformer.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                               tgt_key_padding_mask=tgt_key_padding_mask,
                               memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=tgt_is_causal,
                               memory_is_causal=memory_is_causal)


_TRAINING_FORWARDS = {
    nn.MultiheadAttention: multihead_attention_forward,
    nn.TransformerEncoderLayer: encoder_layer_forward,
    nn.TransformerDecoderLayer: None,   # its own forward traces (module calls only)
    nn.TransformerEncoder: encoder_forward,
    nn.TransformerDecoder: decoder_forward,
    nn.Transformer: transformer_forward,
}


def _torch_type(module: nn.Module) -> type | None:
    return next((kind for kind in _TRAINING_FORWARDS if isinstance(module, kind)), None)


def kept_whole_reason(module: nn.Module) -> str | None:
    """Why a torch transformer module stays one exact leaf (``None``: it is traced through, or it is not one)."""
    kind = _torch_type(module)
    if kind is None:
        return None
    if type(module).forward is not kind.forward:
        return f"{type(module).__name__} overrides {kind.__name__}.forward: kept whole"
    if isinstance(module, nn.MultiheadAttention):
        if module.bias_k is not None or module.add_zero_attn:
            return "nn.MultiheadAttention with add_bias_kv or add_zero_attn: kept whole"
    return None


def training_forward(module: nn.Module):
    """The function torch.fx traces for ``module``'s training computation, called as ``f(*args, **kwargs)``;
    ``None`` when it is not one of :data:`TORCH_TRANSFORMER_TYPES` or stays whole (:func:`kept_whole_reason`)."""
    kind = _torch_type(module)
    if kind is None or kept_whole_reason(module) is not None:
        return None
    function = _TRAINING_FORWARDS[kind]
    if function is None:
        return module.forward
    return lambda *args, **kwargs: function(module, *args, **kwargs)
