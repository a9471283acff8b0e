"""Pickling fxapprox's GraphModules (:class:`~fxapprox.api.ApproxGraphModule`, a hierarchically captured model's
regions): the graph as plain records, node meta included.

``GraphModule`` pickles its generated code and re-traces it on load, which would lose the class, the plan and
state, the nodes' analysis meta and the memory plan's marker nodes (outside a compressing forward they do nothing,
so a tracer records nothing); the graph itself pickles (its targets are importable functions, method names and
submodule paths), so it is stored as records.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["RecordedGraphModule", "graph_from_records", "graph_records", "reduce_graph_module"]


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



def reduce_graph_module(gm: torch.fx.GraphModule, body: dict | None = None) -> tuple:
    """``__reduce__`` of ``gm``: its ``__dict__`` (or ``body``) without the graph and generated code, and the graph
    as records; rebuilt as the same class (``GraphModule`` makes a subclass per instance: its first base)."""
    body = dict(gm.__dict__ if body is None else body)
    graph = body.pop("_graph")
    for generated in ("_code", "_lineno_map", "_prologue_start"):
        body.pop(generated, None)
    return (_rebuild_graph_module, (type(gm).__mro__[1], body, graph_records(graph), graph._codegen,
                                    type(gm).__name__))


def _rebuild_graph_module(cls: type, body: dict, records: list[tuple], codegen, class_name: str):
    from torch import nn

    from fxapprox.runtime.model_state import check_loaded

    check_loaded(body)
    root = nn.Module()
    for key in ("_modules", "_parameters", "_buffers"):
        root.__dict__[key] = body[key]
    module = cls(root, graph_from_records(records, codegen), class_name=class_name)
    for key, value in body.items():
        module.__dict__[key] = value
    return module


class RecordedGraphModule(torch.fx.GraphModule):
    """A ``GraphModule`` that pickles its graph as records: marker nodes and node meta survive ``torch.save``."""

    def __reduce__(self):
        return reduce_graph_module(self)
