"""Analysis and measurement — the blocks of a region-captured model that the memory plan may checkpoint.

In a model captured region by region (``fxapprox.passes.capture.regions``) the natural unit of checkpointing — a
decoder layer, ``model.layers.3`` — runs its own code eagerly: its norms and MLP are traced regions, its
projections swapped leaves, its attention eager code. Such a module is a *region block* when it is an item of a
container (a path ending in an index, as :func:`fxapprox.passes.memory.blocks.block_of` names blocks), runs eagerly,
is called once, and holds regions. Checkpointing it (``fxapprox.runtime.checkpointing.RegionCheckpoint``) frees
everything saved inside it — its regions' values and what its eager code saves — and keeps its inputs (through
the reentrant checkpoint, at the width the plan gives their value: at least
:data:`~fxapprox.passes.memory.memory_widths.CHECKPOINT_INPUT_BITS` bits, as for a traced block's inputs).

Its inputs are the tensors it was called with that require a gradient, matched to the planning graph's
placeholders by identity (the stitched graph receives each region's inputs as placeholders); a block whose input
no region saves is left out (nothing in the plan would hold it). Its re-run cost is its module's forward, timed
with gradients on what it received in the capture step.
"""

from __future__ import annotations

import hashlib

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxapprox.config import ApproxConfig
from fxapprox.passes.capture.regions import Capture, RegionInputs
from fxapprox.passes.capture.stitch import REGION_KEY, tensor_identity
from fxapprox.passes.memory.blocks import Block, node_bytes
from fxapprox.passes.memory.measure_blocks import median_seconds
from fxapprox.passes.memory.saved_values import SavedValue
from fxapprox.pipeline.records import EAGER_COPY_KEY, EAGER_SAVED_KEY, SAME_TENSOR_KEY
from fxapprox.pipeline.timing_cache import TimingCache, _describe

__all__ = ["find_region_blocks", "region_recompute_seconds"]


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def find_region_blocks(gm: torch.fx.GraphModule, inputs: tuple, capture: Capture, received: dict[str, RegionInputs],
                       values: dict[str, SavedValue]) -> list[Block]:
    """The region blocks of the stitched planning graph ``gm`` (run on ``inputs``, its placeholders' values in
    order), in graph order; ``values`` are its saved values."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    by_identity = {}
    for node, value in zip(placeholders, inputs):
        key = tensor_identity(value)
        if key is not None and key not in by_identity:
            by_identity[key] = node.meta.get(SAME_TENSOR_KEY, node.name)
    kinds = {region.path: region.kind for region in capture.regions}
    order = {node.name: index for index, node in enumerate(gm.graph.nodes)}
    root_of = {m.name: name for name, value in values.items() for m in value.members}
    blocks = []
    for region in capture.regions:
        path = region.path
        record = received.get(path)
        if region.kind != "eager" or not path.rsplit(".", 1)[-1].isdigit() or record is None or record.calls != 1:
            continue
        if not any(kind != "eager" and _inside(other, path) and other != path for other, kind in kinds.items()):
            continue
        members = [n for n in gm.graph.nodes if _inside(n.meta.get(REGION_KEY, "\0"), path)]
        names = {n.name for n in members}
        tensors = [t for t in tree_flatten((record.args, record.kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        block_inputs = [by_identity.get(tensor_identity(t)) for t in tensors]
        if not tensors or None in block_inputs:
            continue   # an input no region saves: nothing in the plan would hold it
        inputs_roots = {root_of.get(name, name) for name in block_inputs}
        interior = tuple(name for name, value in values.items()
                         if name not in inputs_roots and value.savers and value.savers <= names
                         and all(m.name in names for m in value.members))
        eager = [n for n in members if n.meta.get(EAGER_SAVED_KEY)]
        by_name = {n.name: n for n in gm.graph.nodes}
        blocks.append(Block(
            name=path, nodes=tuple(sorted(names, key=order.__getitem__)), inputs=tuple(dict.fromkeys(block_inputs)),
            attributes=(), outputs=(), interior=interior, interior_bytes=sum(values[v].exact_bytes for v in interior),
            input_bytes=sum(node_bytes(by_name[i]) for i in dict.fromkeys(block_inputs)), inputs_need_grad=True,
            module_level=True, eager_bytes=sum(n.meta[EAGER_SAVED_KEY] for n in eager),
            eager_copy_bytes=sum(n.meta.get(EAGER_COPY_KEY, n.meta[EAGER_SAVED_KEY]) for n in eager)))
    blocks = [b for b in blocks if b.interior or b.eager_bytes]
    # a block inside another (an expert of a layer) is the outer one's: checkpointed with it
    return [b for b in blocks if not any(o is not b and _inside(b.name, o.name) for o in blocks)]


def region_recompute_seconds(model: nn.Module, blocks: list[Block], received: dict[str, RegionInputs],
                             config: ApproxConfig) -> dict[str, float]:
    """Each block's forward — what checkpointing it adds to backward — timed with gradients on what it received in
    the capture step, through the per-machine timing cache."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cache = TimingCache.for_config(config.timing_cache, device)
    repeats = max(3, config.measure_repeats)
    seconds = {}
    for block in blocks:
        module = model.get_submodule(block.name)
        record = received[block.name]
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
        key = "memory-region-block:" + hashlib.sha256(
            f"{type(module).__qualname__}\n{shapes}\n{_describe(tree_flatten((record.args, record.kwargs))[0])}\n"
            f"{repeats}".encode()).hexdigest()
        cached = cache.get(key)
        if cached is None:
            with torch.enable_grad():
                cached = {"seconds": median_seconds(lambda: type(module).forward(module, *record.args,
                                                                                 **record.kwargs), repeats)}
            cache.put(key, cached)
        seconds[block.name] = cached["seconds"]
    cache.save()
    return seconds
