"""Analysis — the blocks of a graph that the memory plan may checkpoint (recompute in backward).

A *block* is a module that is one item of a container — a path that ends in an index: ``blocks.3`` of a
transformer, ``layer2.1`` of a ResNet, ``model.layers.7`` of a Hugging Face decoder — the unit
``torch.utils.checkpoint`` is applied to by hand. The outermost such module on a node's module stack
(``node.meta["nn_module_stack"]``, which the tracer records) names its block, so a bottleneck's ``downsample.0``
belongs to the bottleneck. A block qualifies when its nodes are one contiguous run of the graph, it returns at
least one tensor, and something in it saves a tensor for backward.

Each :class:`Block` lists its nodes, the activations it reads from outside (its inputs: what a checkpoint keeps),
the modules and parameters it uses, its outputs, and which saved values live only inside it (what checkpointing
frees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from fxapprox.passes.memory.saved_values import SavedValue

__all__ = ["Block", "MemoryTimings", "block_of", "find_blocks", "node_bytes"]


@dataclass(frozen=True)
class Block:
    """A checkpointable block of the graph (see the module docstring); node names in graph order."""

    name: str                      #: the module path, e.g. ``"blocks.3"``
    nodes: tuple[str, ...]         #: its nodes, one contiguous run (``get_attr`` nodes among them excluded)
    inputs: tuple[str, ...]        #: activations it reads from outside, in first-use order
    attributes: tuple[str, ...]    #: ``get_attr`` nodes (parameters, buffers) it reads
    outputs: tuple[str, ...]       #: its nodes read after it
    interior: tuple[str, ...]      #: saved values all of whose savers are inside it (freed by checkpointing)
    interior_bytes: int            #: their exact bytes
    input_bytes: int               #: bytes of its inputs (what a checkpoint keeps exact)
    inputs_need_grad: bool         #: whether an input requires a gradient (the reentrant checkpoint's condition)
    #: a module of a region-captured model (``fxapprox.passes.memory.region_blocks``): checkpointed by its module,
    #: its eager code's saves freed with it (``eager_bytes``, ``eager_copy_bytes`` as copies), its re-run exact
    module_level: bool = False
    eager_bytes: int = 0
    eager_copy_bytes: int = 0


def block_of(node: torch.fx.Node) -> str | None:
    """The outermost module on ``node``'s module stack that is an item of a container (path ending in an index)."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        path = value[0] if isinstance(value, tuple) else key
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def _tensor_meta(node: torch.fx.Node):
    meta = node.meta.get("tensor_meta")
    return meta if hasattr(meta, "shape") else None


def node_bytes(node: torch.fx.Node) -> int:
    """Bytes of ``node``'s tensor value (0 when it is not one tensor)."""
    meta = _tensor_meta(node)
    if meta is None:
        return 0
    numel = 1
    for size in meta.shape:
        numel *= int(size)
    return numel * meta.dtype.itemsize


def find_blocks(gm: torch.fx.GraphModule, values: dict[str, SavedValue]) -> list[Block]:
    """The checkpointable blocks of ``gm`` (shapes propagated, saved bytes measured), in graph order; ``values`` are
    its saved values (:func:`fxapprox.passes.memory.saved_values.saved_values`)."""
    nodes = list(gm.graph.nodes)
    owners = [block_of(n) if n.op in ("call_module", "call_function", "call_method") else None for n in nodes]
    # A node a pass inserted (no module stack) between two nodes of one block runs inside it.
    for index, node in enumerate(nodes):
        if owners[index] is None and node.op != "get_attr" and not node.meta.get("nn_module_stack"):
            before = next((o for o in reversed(owners[:index]) if o is not None), None)
            after = next((o for o in owners[index + 1:] if o is not None), None)
            if before is not None and before == after:
                owners[index] = before
    runs: dict[str, list[int]] = {}
    for index, name in enumerate(owners):
        if name is not None:
            runs.setdefault(name, []).append(index)
    by_name = {n.name: n for n in nodes}
    blocks = []
    for name, indices in runs.items():
        span = nodes[indices[0]:indices[-1] + 1]
        members = {nodes[i].name for i in indices}
        if any(n.name not in members and n.op != "get_attr" for n in span):
            continue   # not contiguous: something else runs in the middle
        inside = [n for n in span if n.name in members]
        inputs, attributes = [], []
        for node in inside:
            for arg in node.all_input_nodes:
                if arg.name in members:
                    continue
                target = attributes if arg.op == "get_attr" else inputs
                if arg.name not in target:
                    target.append(arg.name)
        outputs = tuple(n.name for n in inside if any(u.name not in members for u in n.users))
        if not any(_tensor_meta(n) is not None for n in inside if n.name in outputs):
            continue
        interior = tuple(value_name for value_name, value in values.items()
                         if value.savers and value.savers <= members and value.root.name in members
                         and all(m.name in members for m in value.members))
        if not interior:
            continue
        blocks.append(Block(
            name=name, nodes=tuple(n.name for n in inside), inputs=tuple(inputs), attributes=tuple(attributes),
            outputs=outputs, interior=interior,
            interior_bytes=sum(values[v].exact_bytes for v in interior),
            input_bytes=sum(node_bytes(by_name[i]) for i in inputs),
            inputs_need_grad=any(getattr(_tensor_meta(by_name[i]), "requires_grad", False) for i in inputs)))
    return blocks


@dataclass(frozen=True)
class MemoryTimings:
    """Seconds on the example batch: the exact step, each block's forward, packing + unpacking per exact byte.

    ``value_scale`` calibrates what the values cost against a measured step (:func:`measure_memory_step`): packing
    in isolation misses the hooks' bookkeeping, rebuilding values in backward and attention rebuilt from its
    saved inputs, which a compressing step pays in proportion to what it compresses."""

    step_seconds: float
    recompute_seconds: dict[str, float]
    pack_seconds_per_byte: dict[int, float]
    value_scale: float = 1.0
