"""A ``networkx.DiGraph`` view of a ``GraphModule`` for analyses and export.

Nodes are keyed by fx node name and carry ``op``, ``target`` and a copy of
its fxapprox records (``fxapprox.pipeline.records.node_summary``); an edge ``u → v`` means ``v`` consumes ``u``.
"""

from __future__ import annotations

import networkx as nx
import torch.fx

from fxapprox.op_kinds.registry import LINEAR_TARGETS
from fxapprox.pipeline.records import node_summary


def target_name(node: torch.fx.Node) -> str:
    """A readable name for a node's target (``torch.matmul``, ``layer1.0.conv1``, ...); a functional linear layer
    on a parameter is named by it (``F.linear`` on ``blocks.0.attn.in_proj_weight``: ``blocks.0.attn.in_proj_weight
    (linear)``), so that the plan tells apart the layers it samples."""
    target = node.target
    if isinstance(target, str):
        return target
    if target in LINEAR_TARGETS and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node) \
            and node.args[1].op == "get_attr":
        return f"{node.args[1].target} (linear)"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    if module in ("_operator", "operator"):
        return f"operator.{name}"
    if module.startswith("torch"):
        module = "torch" if module in ("torch", "torch._C._VariableFunctions") else module
    return f"{module}.{name}" if module else name


def to_networkx(gm: torch.fx.GraphModule, records: bool = True) -> nx.DiGraph:
    """The graph as a ``networkx.DiGraph`` (``records=False``: the structure only, no ``fxapprox`` attribute).

    Example::

        >>> g = to_networkx(gm)
        >>> nx.is_directed_acyclic_graph(g)
        True
    """
    graph = nx.DiGraph(name=type(gm).__name__)
    for index, node in enumerate(gm.graph.nodes):
        graph.add_node(node.name, op=node.op, target=target_name(node), index=index,
                       **({"fxapprox": node_summary(node)} if records else {}))
    for node in gm.graph.nodes:
        for user in node.users:
            graph.add_edge(node.name, user.name)
    return graph
