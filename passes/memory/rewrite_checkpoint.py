"""Rewrite — the training forward of a memory plan that checkpoints blocks: each block's nodes moved into a
:class:`~fxapprox.runtime.checkpointing.CheckpointedBlock` called where they stood.

The model's own graph stays flat — it is the graph every pass, the plan, the report and ``export`` read, and what
evaluation runs. This pass builds a *copy* in which each checkpointed block (``fxapprox.passes.memory.blocks``) is one
call: the block's modules (``get_attr`` of the module), parameters and input activations go in, a tuple of its
outputs comes out and ``getitem`` nodes hand them on. The memory plan's marker nodes on a block's outputs move
after the call (the block's own values are not saved: their markers are dropped). The compressing training forward
runs this copy (``ApproxGraphModule``), so a checkpoint never changes a parameter, a module path or a
``state_dict`` key.
"""

from __future__ import annotations

import copy
import operator
import re

import torch.fx

from fxapprox.runtime.checkpointing import CheckpointedBlock, call_module
from fxapprox.runtime.saved_markers import compress_saved, recompute_saved

__all__ = ["block_callable", "block_graph", "block_span", "call_in_place", "checkpointed_forward", "checkpointed_graph",
           "erase_span", "forward_of", "module_targets", "named_runner"]

_MARKERS = (compress_saved, recompute_saved)


def named_runner(block, name: str):
    """A function calling ``block`` under ``name`` (what the graph's code and tracebacks show)."""
    def run(*args):
        return block(*args)
    run.__name__ = run.__qualname__ = name
    return run


def block_graph(span: list[torch.fx.Node], members: set[str], modules: list[str], attributes: list[str],
                 inputs: list[str], outputs: list[str], markers: dict | None = None) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    module_inputs = {target: graph.placeholder(f"module_{i}") for i, target in enumerate(modules)}
    for name in (*attributes, *inputs):
        env[name] = graph.placeholder(name)
    for node in span:
        if node.name not in members:
            continue
        if node.op == "call_module":
            args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
            copied = graph.call_function(call_module, (module_inputs[node.target], *args), kwargs)
        else:
            copied = graph.node_copy(node, lambda n: env[n.name])
        copied.meta = dict(node.meta)
        env[node.name] = copied
        if markers and node.name in markers:   # a compressed re-run: mark the value for the block's own session
            graph.call_function(compress_saved, (copied, *markers[node.name]))
    graph.output(tuple(env[name] for name in outputs))
    return graph


_VIEWS = {"view", "reshape", "transpose", "permute", "flatten", "unsqueeze", "squeeze", "expand", "contiguous",
          "relu_", "add_", "mul_"}


def _reaches_outside(node: torch.fx.Node, members: set[str]) -> bool:
    """Whether ``node`` is a view or in-place result, through others, of a node outside the block."""
    while node.name in members:
        if not (node.op == "call_method" and node.target in _VIEWS) or not node.args:
            return False
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return False
    return True


def module_targets(by_name: dict, block) -> list[str]:
    return list(dict.fromkeys(by_name[n].target for n in block.nodes if by_name[n].op == "call_module"))


def block_span(by_name: dict, nodes) -> list[torch.fx.Node]:
    """The run of the graph from a block's first node to its last (other nodes inside it included)."""
    first, last = by_name[nodes[0]], by_name[nodes[-1]]
    span, node = [], first
    while True:
        span.append(node)
        if node is last:
            return span
        node = node.next


def call_in_place(graph: torch.fx.Graph, span: list, members: set[str], run, modules: list[str],
                  attributes: list[str], input_nodes: list, outputs: list[str], by_name: dict):
    """Insert ``run(*modules, *attributes, *inputs)`` after ``span`` (a block's run of nodes), hand each of its
    ``outputs`` on through a ``getitem`` to every user outside the block; returns ``(last inserted node, {output
    name: getitem node})``. The span itself stays (:func:`erase_span` removes it)."""
    anchor, getters = span[-1], []
    for target in modules:
        with graph.inserting_after(anchor):
            anchor = graph.get_attr(target)
        getters.append(anchor)
    with graph.inserting_after(anchor):
        call = graph.call_function(run, (*getters, *(by_name[a] for a in attributes), *input_nodes))
    anchor = call
    results = {}
    for index, name in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = results[name] = graph.call_function(operator.getitem, (call, index))
        results[name].meta = dict(by_name[name].meta)
    for name in outputs:
        original = by_name[name]
        for user in list(original.users):
            if user.name not in members and user not in span:
                user.replace_input_with(original, results[name])
    return anchor, results


def erase_span(graph: torch.fx.Graph, span: list) -> None:
    """Remove a block's nodes (but its ``get_attr`` nodes) once :func:`call_in_place` replaced them."""
    for node in reversed(span):
        if node.op != "get_attr":
            graph.erase_node(node)


def block_callable(gm: torch.fx.GraphModule, block) -> tuple[torch.fx.GraphModule, list[str]]:
    """``block`` of ``gm`` as a function of its modules (``module_targets`` of them, in order), its ``get_attr``
    values and its inputs, returning the tuple of its outputs; and ``module_targets``. For timing a block alone."""
    by_name = {node.name: node for node in gm.graph.nodes}
    modules = module_targets(by_name, block)
    graph = block_graph([by_name[n] for n in block.nodes], set(block.nodes), modules, list(block.attributes),
                         list(block.inputs), list(block.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Block"), modules


def checkpointed_graph(gm: torch.fx.GraphModule, blocks, saving=None
                       ) -> tuple[torch.fx.Graph, dict[str, CheckpointedBlock]]:
    """A copy of ``gm``'s graph with each of ``blocks`` (:class:`fxapprox.plan.BlockDecision`s) called as a
    :class:`CheckpointedBlock`; returns the graph (code for ``root_module="self"``) and the blocks by name. A block
    with ``recompute_values`` compresses its re-run with ``saving`` (:class:`~fxapprox.runtime.saved_activations.
    SavingOptions`)."""
    graph = copy.deepcopy(gm.graph)
    made: dict[str, CheckpointedBlock] = {}
    handed_on: dict[str, torch.fx.Node] = {}   # an earlier block's output → the getitem that now carries it
    for block in blocks:
        by_name = {node.name: node for node in graph.nodes}
        input_nodes = [handed_on.get(name) or by_name[name] for name in block.inputs]
        members = set(block.nodes)
        span = block_span(by_name, block.nodes)
        outputs = list(block.outputs)
        moved = []
        for node in span:
            if node.name in members or node.op == "get_attr":
                continue
            if node.target in _MARKERS:
                value = node.args[0]
                if node.target is compress_saved and value.name in outputs:
                    moved.append((value.name, node.args[1:], dict(node.kwargs)))
                elif value.name not in members:
                    raise RuntimeError(f"fxapprox: a marker for {value.name!r} stands inside block {block.name!r}")
                elif node.target is recompute_saved and value.name in outputs:
                    raise RuntimeError(f"fxapprox: block {block.name!r} is checkpointed but its output "
                                       f"{value.name!r} is planned to be rebuilt from inside it")
                elif _reaches_outside(value, members):
                    raise RuntimeError(f"fxapprox: block {block.name!r} is checkpointed but {value.name!r}, an "
                                       f"alias of a value from outside it, is planned to be compressed")
                continue
            raise RuntimeError(f"fxapprox: node {node.name!r} runs inside block {block.name!r} but is not part of "
                               f"it; the block cannot be checkpointed")
        modules = module_targets(by_name, block)
        rerun = {name: (bits, sign_exact) for name, bits, sign_exact in getattr(block, "recompute_values", ())}
        code = block_graph(span, members, modules, list(block.attributes), [n.name for n in input_nodes], outputs,
                           rerun)
        compressed = getattr(block, "inputs_copied", False) or any(
            user.target in _MARKERS for node in input_nodes for user in node.users)
        checkpointed = CheckpointedBlock(code, block.name, compressed_inputs=compressed,
                                         recompute_saving=saving if rerun else None)
        made[block.name] = checkpointed
        run = named_runner(checkpointed, "checkpointed_" + re.sub(r"\W", "_", block.name))
        anchor, results = call_in_place(graph, span, members, run, modules, list(block.attributes), input_nodes,
                                        outputs, by_name)
        handed_on.update(results)
        for name, args, kwargs in moved:
            with graph.inserting_after(anchor):
                anchor = graph.call_function(compress_saved, (results[name], *args), kwargs)
        erase_span(graph, span)
    graph.lint()
    return graph, made


def checkpointed_forward(gm: torch.fx.GraphModule, blocks, saving=None):
    """The ``forward(self, *args, **kwargs)`` of :func:`checkpointed_graph`'s copy, compiled (call it with ``gm``)."""
    graph, made = checkpointed_graph(gm, blocks, saving)
    forward = forward_of(graph, "<fxapprox: checkpointed training forward>")
    forward.blocks = made   # the CheckpointedBlock of each block, by name (for inspection)
    return forward


def forward_of(graph: torch.fx.Graph, filename: str):
    """``graph``'s code as a ``forward(self, *args, **kwargs)`` function (call it with the module it was copied
    from), compiled under ``filename`` (what tracebacks and dynamo show)."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102
    return namespace["forward"]
