"""Pass 6b — when activations are compressed, attention rebuilds its softmax from its saved inputs.

Replaces ``F.scaled_dot_product_attention`` calls without dropout by
:func:`fxapprox.ops.attention.attention_from_saved_inputs`: the same kernel forward (the
same function outside a compressing training forward), a backward that normalises the
attention weights of the rebuilt q and k again instead of reusing the exact forward's
log-sum-exp (see that module for why). The memory plan then sees attention saving its
three inputs only.
"""

from __future__ import annotations

import torch.fx
import torch.nn.functional as F

from fxapprox.ops.attention import attention_from_saved_inputs

_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def recompute_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Swap every dropout-free ``scaled_dot_product_attention`` call; returns ``gm`` (recompiled).

    Example::

        >>> gm = recompute_attention(torch.fx.symbolic_trace(model))
        >>> [n.target.__name__ for n in gm.graph.nodes if n.name.startswith("scaled_dot_product")]
        ['attention_from_saved_inputs']
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
            continue
        values = dict(zip(_ARGUMENTS, node.args))
        values.update(node.kwargs)
        dropout = values.get("dropout_p", 0.0)
        if isinstance(dropout, torch.fx.Node) or dropout:
            continue
        node.target = attention_from_saved_inputs
    gm.graph.lint()
    gm.recompile()
    return gm
