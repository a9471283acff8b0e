"""Analysis — the blocks whose backward the row family may sample (``fxapprox.ops.rows``).

A *row block* is the outermost module on a layer's path that is an item of a container (a path ending in an
index: ``blocks.3``, ``model.layers.7``; not the layer itself, as in an MLP's ``nn.Sequential``) and holds linear
layers the row family replays — ``nn.Linear``,
``F.linear`` and ``x @ W`` with the parameter on the right, Hugging Face's ``Conv1D`` — the unit VCAS samples after.
For each, in forward order: its layers, and the FLOPs of one training step split the way a row-sampled step spends
them (:class:`RowBlock`): the linear layers' forward (recorded, not repeated), input gradients and weight
gradients, and everything else the block runs (norms, activations, attention; in a model captured region by region
its eager code too), whose forward the replay repeats on the kept rows.

Which nodes belong to a block is read from where they run: a ``call_module`` node's path, an eager module's path,
the module stack torch.fx records (relative to its region in a region-captured model). In a traced model the
block's nodes must be one contiguous run of the graph (the training forward calls them as one unit); a model
captured region by region calls the block's module itself, which must run once per forward. Whether the block
treats its samples independently and deterministically is measured on the example batch
(``fxapprox.passes.measurement.measure_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx

from fxapprox.op_kinds.registry import handler_for
from fxapprox.pipeline.records import flops_of, kind_of

__all__ = ["ROW_BLOCKS_KEY", "ROW_KINDS", "RowBlock", "block_path", "find_row_blocks", "node_path", "row_blocks_of"]

#: ``gm.meta`` key: the row blocks (a list of :class:`RowBlock`, forward order)
ROW_BLOCKS_KEY = "fxapprox_row_blocks"
#: the op kinds a row block's replay hands back instead of recomputing (linear layers, parameter operand right)
ROW_KINDS = ("linear", "linear_fn", "matmul", "conv1d_hf")
#: ``node.meta`` key of a stitched graph's nodes: the region they came from (``passes/capture/stitch.py``)
_REGION_KEY = "fxapprox_region"


@dataclass(frozen=True)
class RowBlock:
    """A block the row family may sample, and what one training step of it costs (FLOPs)."""

    name: str                       #: module path, e.g. ``"blocks.3"``
    layers: tuple[str, ...]         #: its replayable linear layers' nodes, graph order
    nodes: tuple[str, ...]          #: every node of it, graph order
    linear_forward: int             #: its linear layers' forward
    linear_input_grad: int          #: their input-gradient products
    linear_weight_grad: int         #: their weight-gradient products (and biases)
    other_forward: int              #: everything else it runs, forward
    other_backward: int             #: and backward
    contiguous: bool = True         #: its nodes are one run of the graph (a traced model calls them as one unit)
    blocker: str | None = None      #: why it cannot be row-sampled (``None``: it can)

    @property
    def exact_flops(self) -> int:
        return (self.linear_forward + self.linear_input_grad + self.linear_weight_grad + self.other_forward
                + self.other_backward)

    def flops(self, ratio: float, token_ratio: float = 1.0) -> float:
        """Training FLOPs with ``ratio`` of the samples kept and ``token_ratio`` of their tokens in the weight
        gradients: the forward whole, the replay's other ops and every backward on the kept rows. At ``ratio`` 1
        nothing is replayed (the block runs as it is, only its weight gradients sampled)."""
        if ratio >= 1.0:
            return self.exact_flops - (1.0 - token_ratio) * self.linear_weight_grad
        return self.linear_forward + self.other_forward + ratio * self.per_ratio(token_ratio)

    def per_ratio(self, token_ratio: float = 1.0) -> float:
        """What a replayed step's FLOPs grow by per unit of keep-ratio: the replay's other ops, forward and backward,
        and the linear layers' backward (their weight gradients at ``token_ratio``)."""
        return (self.other_forward + self.other_backward + self.linear_input_grad
                + token_ratio * self.linear_weight_grad)

    def breakeven(self, token_ratio: float = 1.0) -> float:
        """The keep-ratio below which replaying the block on its kept rows costs fewer FLOPs than running it whole
        (the replay repeats its other ops' forward)."""
        scaled = self.per_ratio(token_ratio)
        return (self.flops(1.0, token_ratio) - self.flops(0.0, token_ratio)) / scaled if scaled > 0 else 1.0

    def to_dict(self) -> dict:
        return {"name": self.name, "layers": list(self.layers), "nodes": list(self.nodes),
                "linear_forward": self.linear_forward, "linear_input_grad": self.linear_input_grad,
                "linear_weight_grad": self.linear_weight_grad, "other_forward": self.other_forward,
                "other_backward": self.other_backward, "contiguous": self.contiguous, "blocker": self.blocker}


def node_path(node: torch.fx.Node) -> str:
    """The module path ``node`` runs in (``""``: the model's own code)."""
    if node.op == "call_module" and not node.target.startswith("fxapprox_"):
        return node.target   # (fxapprox's own modules — a mode-following call, a sampled F.linear — sit at the root)
    eager_path = getattr(node.target, "path", None)
    if isinstance(eager_path, str) and type(node.target).__name__ == "EagerCode":
        return eager_path
    inner = ""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        inner = value[0] if isinstance(value, tuple) else key
    region = node.meta.get(_REGION_KEY)
    if region:
        return f"{region}.{inner}" if inner else region
    return inner


def block_path(path: str) -> str | None:
    """The outermost container item on ``path`` (``"blocks.0.mlp.2"`` → ``"blocks.0"``), or ``None``."""
    parts = path.split(".")
    for end in range(1, len(parts) + 1):
        if parts[end - 1].isdigit():
            return ".".join(parts[:end])
    return None


def _under(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def _replayable(node: torch.fx.Node) -> bool:
    kind = kind_of(node)
    return (handler_for(node) is not None and kind.op_kind in ROW_KINDS
            and kind.parameter_side in (None, "right"))


def find_row_blocks(gm: torch.fx.GraphModule) -> list[RowBlock]:
    """The row blocks of ``gm`` (FLOPs counted, layer kinds known), in forward order; written to
    ``gm.meta[ROW_BLOCKS_KEY]`` too."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    paths = {n.name: node_path(n) for n in nodes}
    names: list[str] = []
    for node in nodes:
        if _replayable(node):
            block = block_path(paths[node.name])
            # a layer that is itself a container's item (an MLP's nn.Sequential) is a layer, not a block
            if block is not None and block != paths[node.name] and block not in names:
                names.append(block)
    order = [n.name for n in nodes]
    blocks = []
    for name in names:
        members = [n for n in nodes if _under(paths[n.name], name)]
        positions = [order.index(n.name) for n in members]
        contiguous = positions == list(range(positions[0], positions[0] + len(positions)))
        flops = {"linear_forward": 0, "linear_input_grad": 0, "linear_weight_grad": 0, "other_forward": 0,
                 "other_backward": 0}
        layers = []
        for node in members:
            count = flops_of(node)
            if _replayable(node):
                layers.append(node.name)
                weight = handler_for(node).weight_grad_flops(node)
                flops["linear_forward"] += count.forward
                flops["linear_weight_grad"] += weight
                flops["linear_input_grad"] += max(0, count.backward - weight)
            else:
                flops["other_forward"] += count.forward
                flops["other_backward"] += count.backward
        blocks.append(RowBlock(name=name, layers=tuple(layers), nodes=tuple(n.name for n in members),
                               contiguous=contiguous, **flops))
    gm.meta[ROW_BLOCKS_KEY] = blocks
    return blocks


def row_blocks_of(gm: torch.fx.GraphModule) -> list[RowBlock]:
    """What :func:`find_row_blocks` (and the probe after it) wrote: ``[]`` when it did not run."""
    return list(gm.meta.get(ROW_BLOCKS_KEY, ()))


def with_blocker(block: RowBlock, reason: str | None) -> RowBlock:
    return replace(block, blocker=reason)
