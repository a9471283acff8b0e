"""Pickling an :class:`~fxapprox.api.ApproxGraphModule`: its graph as plain records, node meta included.

``GraphModule`` pickles its generated code and re-traces it on load, which would lose the class, the plan and
state, the nodes' analysis meta and the memory plan's marker nodes; the graph itself pickles (its targets are
importable functions, method names and submodule paths), so it is stored as records.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["graph_from_records", "graph_records"]


class _NodeName(str):
    """A reference to another node inside a pickled node record."""


def graph_records(graph: torch.fx.Graph) -> list[tuple]:
    """The graph as plain records ``(op, name, target, args, kwargs, type, meta)``, node references by name
    (a ``Graph`` object refers back to its module, a cycle pickle cannot rebuild)."""
    def by_name(value):
        return torch.fx.node.map_arg(value, lambda node: _NodeName(node.name))

    return [(node.op, node.name, node.target, by_name(node.args), by_name(node.kwargs), node.type,
             _map_memory_formats(dict(node.meta), lambda f: _MemoryFormatName(str(f).rsplit(".", 1)[-1])))
            for node in graph.nodes]


class _MemoryFormatName(str):
    """A ``torch.memory_format`` by name: ShapeProp's metadata holds them and torch.save's pickle protocol (2)
    cannot pickle one."""


def _map_memory_formats(value, convert, kind=torch.memory_format):
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, dict):
        return type(value)((k, _map_memory_formats(v, convert, kind)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a NamedTuple (TensorMetadata)
        return type(value)(*(_map_memory_formats(v, convert, kind) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_memory_formats(v, convert, kind) for v in value)
    return value


def graph_from_records(records: list[tuple], codegen) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}

    def resolve(value):
        return torch.fx.node.map_aggregate(value, lambda v: nodes[v] if isinstance(v, _NodeName) else v)

    for op, name, target, args, kwargs, type_expr, meta in records:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name, type_expr=type_expr)
        node.meta = _map_memory_formats(meta, lambda name: getattr(torch, name), kind=_MemoryFormatName)
        nodes[name] = node
    graph._codegen = codegen
    return graph

