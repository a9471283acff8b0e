"""The saved values of a planning graph, as the memory policy sees them: one :class:`SavedValue` per tensor (a root
node and its aliases: views, in-place writes, the same tensor received by several regions), with the bytes its
savers keep, who saves it, and the floor on its width.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from fxapprox.ops.attention import attention_from_saved_inputs
from fxapprox.ops.quantize import quantized_nbytes
from fxapprox.pipeline.records import EAGER_SAVED_KEY, SAME_TENSOR_KEY, saved_of
from fxapprox.runtime.saved_tensors import memory_row

__all__ = ["EXPONENTIATING_SAVERS", "SavedValue", "dtype_bits", "is_relu", "mib",
           "saved_values"]

#: savers whose backward exponentiates a product of their saved inputs, with the fewest bits those inputs keep.
#: Attention's weights are ``softmax(q·kᵀ)``: a quantisation error in the scores is multiplied through ``exp``, and
#: it grows as the model trains, which the example batch (at initialisation, near-uniform attention) does not
#: show. ``benchmarks/bench_planner.py`` ("attention") measures the 4-bit cost of q, k and v at initialisation and
#: after training, with the rebuilt attention of ``fxapprox/ops/attention.py`` and with the kernel's own backward
#: (with which, at 4 bits everywhere, the char transformer's loss was NaN from step 300 in a run outside the
#: benchmarks).
EXPONENTIATING_SAVERS = {torch.nn.functional.scaled_dot_product_attention: 8, attention_from_saved_inputs: 8}
RELU_FUNCTIONS = {torch.relu, torch.relu_, torch.nn.functional.relu, torch.nn.functional.relu_}
#: the fewest bits BatchNorm's saved input keeps. Its backward divides by each channel's batch deviation, but a
#: group of the copy spans several channels once a feature map is smaller than the group (16 channels of a 4×4
#: map at 256 elements): a channel whose deviation is far below its group's range gets an error far above its
#: own scale, which grows as training sharpens the channels. ResNet-18 on digits with 2-bit copies everywhere:
#: the gradient norm went 38 → 10⁵ → NaN within 14 SGD steps (``benchmarks/bench_memory_frontier.py``'s quality
#: section measured NaN at ``memory_budget=0.0625``).
BATCH_NORM_MIN_BITS = 8


def is_relu(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ReLU (whose backward needs only ``result > 0``)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.ReLU)
    if node.op == "call_function":
        return node.target in RELU_FUNCTIONS
    return node.op == "call_method" and node.target in ("relu", "relu_")


def _is_batch_norm(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.modules.batchnorm._BatchNorm)
    return node.op == "call_function" and node.target in (torch.nn.functional.batch_norm, torch.batch_norm)


def dtype_bits(dtype) -> int:
    return torch.finfo(dtype).bits if dtype is not None and dtype.is_floating_point else 32


def mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


class SavedValue:
    """A tensor behind one or more graph values (a root and its aliases)."""

    def __init__(self, root: torch.fx.Node) -> None:
        self.root = root
        self.members: list[torch.fx.Node] = [root]
        self.direct = 0          # bytes of the tensor itself, if saved
        self.derived = 0         # bytes of copies sampled ops make of it and save
        self.savers: set[str] = set()
        self.sign_only = True
        self.min_bits = 0        # a floor on its width (see EXPONENTIATING_SAVERS), with the saver behind it
        self.floor_saver: str | None = None
        self.floor_reason = ""   # what that saver's backward does with it, in words
        tensor_meta = root.meta.get("tensor_meta")
        self.dtype = getattr(tensor_meta, "dtype", None)
        self.shape = list(tensor_meta.shape) if hasattr(tensor_meta, "shape") else None
        # the row its copy's groups align to (fxapprox.ops.quantize.row_group)
        self.row = (memory_row(tensor_meta.shape, tensor_meta.stride)
                    if getattr(tensor_meta, "stride", None) is not None else None)

    @property
    def exact_bytes(self) -> int:
        return self.direct + self.derived

    def bytes_at(self, bits: int, group_size: int = 256) -> int:
        width = dtype_bits(self.dtype)
        if bits >= width:
            return self.exact_bytes
        element = width // 8
        total = 0
        for part, row in ((self.direct, self.row), (self.derived, None)):
            if part:
                total += quantized_nbytes(part // element, bits, group_size, row)
        return total


def saved_values(gm: torch.fx.GraphModule) -> tuple[dict[str, SavedValue], int, int]:
    root_of: dict[str, str] = {}
    values: dict[str, SavedValue] = {}
    for node in gm.graph.nodes:
        alias = saved_of(node).alias_of or node.meta.get(SAME_TENSOR_KEY)
        if alias is not None and alias in root_of:
            root_of[node.name] = root_of[alias]
            values[root_of[alias]].members.append(node)
        else:
            root_of[node.name] = node.name
            values[node.name] = SavedValue(node)
    internal = internal_bool = 0
    for node in gm.graph.nodes:
        saved = saved_of(node)
        for source, size in saved.saved_from.items():
            value = values[root_of[source]]
            value.direct = max(value.direct, size)
            value.savers.add(node.name)
            if not (is_relu(gm, node) and root_of[node.name] == value.root.name):
                value.sign_only = False
            if node.target in EXPONENTIATING_SAVERS and root_of[node.name] != value.root.name:
                value.min_bits, value.floor_saver = EXPONENTIATING_SAVERS[node.target], node.name
                value.floor_reason = "exponentiates a product of its saved inputs in backward"
            elif _is_batch_norm(gm, node) and value.min_bits < BATCH_NORM_MIN_BITS:
                value.min_bits, value.floor_saver = BATCH_NORM_MIN_BITS, node.name
                value.floor_reason = "divides by each channel's batch deviation in backward"
        for source, size in saved.saved_derived.items():
            value = values[root_of[source]]
            value.derived += size
            value.savers.add(node.name)
            value.sign_only = False
        # eager code's saves (a hierarchically captured model, passes/capture/eager_saved.py) stay as they are, too
        internal += saved.internal_bytes + node.meta.get(EAGER_SAVED_KEY, 0)
        internal_bool += saved.internal_bool_bytes
    return {name: v for name, v in values.items() if v.exact_bytes}, internal, internal_bool
