"""Rewrite — the training forward of a plan that samples rows (``fxapprox.ops.rows``): each row-sampled block
called as one unit, a :class:`~fxapprox.ops.rows.RowSampledBlock`.

A traced model's own graph stays flat (it is what the plan, the report, ``export`` and evaluation read); like the
checkpointed forward (``fxapprox.passes.memory.rewrite_checkpoint``), a *copy* of it calls each row block's nodes as
one ``RowSampledBlock`` on the block's modules, parameters and inputs, whose tuple of outputs ``getitem`` nodes hand
on. A model captured region by region calls its blocks' modules itself: each is given the row-sampled call in place
(:func:`~fxapprox.runtime.row_blocks.wrap_row_block`), its class a subclass of its own, its parameters and
``state_dict`` keys untouched.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
import torch.fx

from fxapprox.passes.analysis.row_blocks import RowBlock
from fxapprox.passes.memory.rewrite_checkpoint import (block_graph, block_span, call_in_place, erase_span, forward_of,
                                                       module_targets, named_runner)
from fxapprox.ops.rows import RowSampledBlock

__all__ = ["BlockUnit", "block_unit", "row_sampled_forward", "row_sampled_graph"]


@dataclass(frozen=True)
class BlockUnit:
    """A traced block as one unit: its modules (targets), ``get_attr`` values, input and output nodes, and its code
    (a ``GraphModule`` of them, returning the tuple of its outputs)."""

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    attributes: tuple[str, ...]
    outputs: tuple[str, ...]
    modules: tuple[str, ...]
    code: torch.fx.GraphModule

    def call_args(self, gm: torch.fx.GraphModule, input_values) -> tuple:
        """The code's arguments: the modules and attributes of ``gm``, then ``input_values``."""
        modules = [gm.get_submodule(t) for t in self.modules]
        attributes = [_attribute(gm, next(n for n in gm.graph.nodes if n.name == a).target) for a in self.attributes]
        return (*modules, *attributes, *input_values)


def _attribute(gm: torch.fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _interface(graph: torch.fx.Graph, nodes) -> tuple[list[str], list[str], list[str]]:
    """``(inputs, attributes, outputs)`` of the run of ``nodes`` in ``graph``."""
    members = set(nodes)
    by_name = {n.name: n for n in graph.nodes}
    inputs, attributes = [], []
    for name in nodes:
        for arg in by_name[name].all_input_nodes:
            if arg.name in members:
                continue
            target = attributes if arg.op == "get_attr" else inputs
            if arg.name not in target:
                target.append(arg.name)
    outputs = [name for name in nodes if any(u.name not in members for u in by_name[name].users)]
    return inputs, attributes, outputs


def block_unit(gm: torch.fx.GraphModule, block: RowBlock) -> BlockUnit:
    """``block`` of ``gm`` (a contiguous one) as a :class:`BlockUnit`."""
    by_name = {n.name: n for n in gm.graph.nodes}
    inputs, attributes, outputs = _interface(gm.graph, block.nodes)
    modules = module_targets(by_name, block)
    graph = block_graph([by_name[n] for n in block.nodes], set(block.nodes), modules, attributes, inputs, outputs)
    return BlockUnit(block.name, block.nodes, tuple(inputs), tuple(attributes), tuple(outputs), tuple(modules),
                     torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Block"))


def row_sampled_graph(gm: torch.fx.GraphModule, blocks: list[RowBlock], sampler
                      ) -> tuple[torch.fx.Graph, dict[str, RowSampledBlock]]:
    """A copy of ``gm``'s graph with each of ``blocks`` called as a :class:`RowSampledBlock` sampling with
    ``sampler`` (:class:`fxapprox.ops.rows.RowSampler`); returns the graph (code for ``root_module="self"``) and the
    blocks by name."""
    graph = copy.deepcopy(gm.graph)
    made: dict[str, RowSampledBlock] = {}
    handed_on: dict[str, torch.fx.Node] = {}
    for block in blocks:
        by_name = {node.name: node for node in graph.nodes}
        inputs, attributes, outputs = _interface(graph, block.nodes)
        input_nodes = [handed_on.get(name) or by_name[name] for name in inputs]
        members = set(block.nodes)
        span = block_span(by_name, block.nodes)
        stray = [n.name for n in span if n.name not in members and n.op != "get_attr"]
        if stray:
            raise RuntimeError(f"fxapprox: node {stray[0]!r} runs inside row block {block.name!r} but is not part of "
                               f"it; the block cannot be called as one unit")
        modules = module_targets(by_name, block)
        code = block_graph(span, members, modules, attributes, [n.name for n in input_nodes], outputs)
        unit = RowSampledBlock(code, block.name, sampler, n_modules=len(modules), n_attributes=len(attributes))
        made[block.name] = unit
        run = named_runner(unit, "row_sampled_" + re.sub(r"\W", "_", block.name))
        _, results = call_in_place(graph, span, members, run, modules, attributes, input_nodes, outputs, by_name)
        handed_on.update(results)
        erase_span(graph, span)
    graph.lint()
    return graph, made


def row_sampled_forward(gm: torch.fx.GraphModule, blocks: list[RowBlock], sampler):
    """The ``forward(self, *args, **kwargs)`` of :func:`row_sampled_graph`'s copy, compiled (call it with ``gm``)."""
    graph, made = row_sampled_graph(gm, blocks, sampler)
    forward = forward_of(graph, "<fxapprox: row-sampled training forward>")
    forward.blocks = made
    return forward
