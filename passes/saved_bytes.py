"""Pass 2c — saved activations: bytes each node makes autograd keep for backward.

Runs each node in isolation under ``torch.autograd.graph.saved_tensors_hooks``
and adds up the distinct tensors packed, leaving out parameters and buffers
(they are stored anyway). Writes ``saved_bytes`` and ``saved_tensors`` into
``node.meta["fxapprox"]``. A tensor that feeds several nodes is counted at
each of them (the per-node view the policy needs).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.autograd.graph import saved_tensors_hooks

from fxapprox.passes._isolation import NodeIsolationInterpreter
from fxapprox.passes._meta import fx_meta


def _storage_key(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # mkldnn/sparse tensors have no plain storage
        return None


class SavedBytesInterpreter(NodeIsolationInterpreter):
    description = "measuring saved activations"

    def __init__(self, gm: torch.fx.GraphModule, progress: bool = False) -> None:
        super().__init__(gm, progress)
        self._state_storages = {
            _storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())
        } - {None}

    def measure(self, node, run, grad_inputs) -> None:
        packed: dict[tuple, int] = {}
        state_storages = self._state_storages

        def pack(tensor: torch.Tensor) -> int:
            storage = _storage_key(tensor)
            if storage not in state_storages:
                key = (storage, tensor.storage_offset() if storage is not None else id(tensor),
                       tuple(tensor.shape), tensor.dtype)
                packed[key] = tensor.numel() * tensor.element_size()
            # Keep only a size, never the tensor: a packed output that refers back to
            # its own grad_fn makes a C++ reference cycle that the gc cannot free.
            return 0

        def unpack(_: int) -> torch.Tensor:
            raise RuntimeError("the saved-bytes pass never runs backward")

        with saved_tensors_hooks(pack, unpack):
            run()
        meta = fx_meta(node)
        meta["saved_bytes"] = int(sum(packed.values()))
        meta["saved_tensors"] = len(packed)


def measure_saved_bytes(gm: torch.fx.GraphModule, *example_inputs, progress: bool = False) -> torch.fx.GraphModule:
    """Annotate every node with the bytes of activations it saves for backward.

    Example::

        >>> measure_saved_bytes(gm, torch.randn(8, 3, 64, 64))
        >>> gm.graph.find_nodes(op="call_module", target="conv1")[0].meta["fxapprox"]["saved_bytes"]
    """
    for node in gm.graph.nodes:
        meta = fx_meta(node)
        meta["saved_bytes"] = 0
        meta["saved_tensors"] = 0
    SavedBytesInterpreter(gm, progress=progress).run(*example_inputs)
    return gm
