"""Pass 2d — layer kinds and channels: what each node computes and over how many pairs.

A pure graph pass (no execution). For every node it writes a
:class:`~fxapprox.pipeline.records.LayerKind` under ``node.meta[KIND_KEY]``:
``op_kind`` (the name of its registered :class:`fxapprox.op_kinds.registry.OpKind` —
``"linear"``, ``"conv2d"``, ``"matmul"``, ``"lstm"``, … — a recognised kind
without an approximate version such as ``"gru"``, or ``None``), ``in_channels``,
``out_channels``, ``groups``, ``reduction_size`` (the number of column-row
pairs a sampled version chooses from) and, for functional ops,
``parameter_operand`` / ``parameter_side``. Matching is the registry's: see
``fxapprox/op_kinds/registry.py``.
"""

from __future__ import annotations

import torch.fx

from fxapprox.op_kinds.registry import conv2d_call_args, match_node
from fxapprox.pipeline.records import KIND_KEY, LayerKind

__all__ = ["annotate_channels", "conv2d_call_args"]


def annotate_channels(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write ``op_kind``, channels and ``reduction_size`` for every node.

    Example::

        >>> annotate_channels(gm)
        >>> kind_of(gm.graph.find_nodes(op="call_module", target="fc")[0]).op_kind
        'linear'
    """
    for node in gm.graph.nodes:
        _, info = match_node(gm, node) if node.op in ("call_module", "call_function", "call_method") else \
            (None, {"op_kind": None})
        node.meta[KIND_KEY] = LayerKind.from_match(info)
    return gm
