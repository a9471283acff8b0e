"""Where the passes keep their results: ``node.meta["fxapprox"]``, a flat dict."""

from __future__ import annotations

import torch.fx

META_KEY = "fxapprox"
#: ``node.meta`` key (True) of a node that is not the model's own (the stitched planning graph's loss): the
#: per-node analyses leave it out
OUTSIDE_MODEL_KEY = "fxapprox_outside_model"
#: ``node.meta`` key (True) of a placeholder of a stitched planning graph whose value's gradient flows on into code
#: outside the graph (a region's input that requires grad): the error policies' propagation counts it
UPSTREAM_OUTSIDE_KEY = "fxapprox_upstream_outside"
#: ``node.meta`` key of a placeholder of a stitched planning graph: the name of an earlier placeholder holding the
#: same tensor (two regions read it); the memory policy treats it as an alias
SAME_TENSOR_KEY = "fxapprox_same_tensor_as"


def fx_meta(node: torch.fx.Node) -> dict:
    """The fxapprox analysis/plan dict of ``node`` (created empty on first use)."""
    return node.meta.setdefault(META_KEY, {})


def train_flops(node: torch.fx.Node) -> int:
    """Forward + backward FLOPs of ``node`` measured by the flops pass (0 if none)."""
    meta = node.meta.get(META_KEY, {})
    return int(meta.get("flops_fwd", 0)) + int(meta.get("flops_bwd", 0))
