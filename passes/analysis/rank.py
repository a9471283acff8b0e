"""Pass 3 — ranking: order the layers a sampled op could replace.

The papers find that wide, expensive layers tolerate sampling best, and that
is also where sampling saves the most. The score is the layer's measured
training FLOPs times the square root of its reduction size (the number of
column-row pairs it sums over), so among layers of similar cost the wider one
comes first. Writes ``rank`` (1 = first) and ``rank_score``. The FLOP policy
walks this order; the measured policy ranks by measured error instead and
keeps this rank for the report.
"""

from __future__ import annotations

import math

import torch.fx

from fxapprox.op_kinds.registry import handler_for
from fxapprox.pipeline.records import RANK_KEY, LayerRank, kind_of, train_flops


def rank_layers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Rank every node of an approximable kind; returns them best first.

    Example::

        >>> ranked = rank_layers(gm)
        >>> rank_of(ranked[0]).rank
        1
    """
    layers = [n for n in gm.graph.nodes if handler_for(n) is not None]
    scores = {node: float(train_flops(node) * math.sqrt(kind_of(node).reduction_size or 1)) for node in layers}
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    layers.sort(key=lambda n: (-scores[n], order[n]))
    for rank, node in enumerate(layers, start=1):
        node.meta[RANK_KEY] = LayerRank(rank, scores[node])
    return layers
