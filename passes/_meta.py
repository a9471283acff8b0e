"""Where the passes keep their results: ``node.meta["fxapprox"]``, a flat dict."""

from __future__ import annotations

import torch.fx

META_KEY = "fxapprox"


def fx_meta(node: torch.fx.Node) -> dict:
    """The fxapprox analysis/plan dict of ``node`` (created empty on first use)."""
    return node.meta.setdefault(META_KEY, {})


def train_flops(node: torch.fx.Node) -> int:
    """Forward + backward FLOPs of ``node`` measured by the flops pass (0 if none)."""
    meta = node.meta.get(META_KEY, {})
    return int(meta.get("flops_fwd", 0)) + int(meta.get("flops_bwd", 0))
