"""Pass 2c — saved activations: bytes each node makes autograd keep for backward, and from where.

Runs each node in isolation under ``torch.autograd.graph.saved_tensors_hooks``
and adds up the distinct tensors packed, leaving out parameters and buffers
(they are stored anyway). Writes a :class:`~fxapprox.pipeline.records.SavedTensors`
under ``node.meta[SAVED_KEY]``:

* ``saved_bytes`` / ``saved_tensors`` — the node's own total (a tensor that
  feeds several nodes is counted at each of them: the per-layer view);
* ``saved_from`` — ``{value node name: bytes}``: which graph values the saved
  tensors are (an input of the node, or its own output, as ReLU saves its
  result); a copy a sampled op derives from an input (the gathered columns,
  reported through ``fxapprox.ops.training_context.note_derived``) is listed under
  ``saved_derived`` for that input instead;
* ``saved_internal_bytes`` — temporaries that are no graph value (BatchNorm's
  batch statistics, dropout masks; ``saved_internal_bool_bytes`` of them are
  boolean);
* ``alias_of`` / ``inplace`` — the input whose storage the node's output shares
  (a view or an in-place op), which the memory policy needs to see one tensor
  behind several graph values.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from fxapprox.ops.training_context import record_derivations
from fxapprox.passes.measurement._isolation import NodeIsolationInterpreter
from fxapprox.pipeline.records import SAVED_KEY, SavedTensors
from fxapprox.runtime.saved_tensors import state_storages, storage_ptr


class SavedBytesInterpreter(NodeIsolationInterpreter):
    description = "measuring saved activations"

    def __init__(self, gm: torch.fx.GraphModule, progress: bool = False) -> None:
        super().__init__(gm, progress)
        self._state_storages = state_storages(gm)
        self._isolated_state: set[int | None] = set()   # copies of state's views, for the node being measured

    def _input_storages(self, node: torch.fx.Node) -> dict[int, tuple[str, int, torch.Tensor]]:
        """Storage of each isolated tensor input → (the graph node it is, its version before running, it)."""
        arg_leaves = tree_flatten((node.args, node.kwargs))[0]
        value_leaves = tree_flatten(self.isolated_inputs)[0]
        storages = {}
        for arg, value in zip(arg_leaves, value_leaves):
            if isinstance(arg, torch.fx.Node) and isinstance(value, torch.Tensor):
                storage = storage_ptr(value)
                real = self.env.get(arg)
                if isinstance(real, torch.Tensor) and storage_ptr(real) in self._state_storages:
                    # a view of a parameter or buffer (``weight.T``): stored anyway. The isolated run copies it, so
                    # its copy's storage is not state's.
                    self._isolated_state.add(storage)
                elif storage is not None and storage not in self._state_storages:
                    storages.setdefault(storage, (arg.name, value._version, value))
        return storages

    def measure(self, node, run, grad_inputs) -> None:
        packed: dict[tuple, tuple[int | None, int, torch.dtype]] = {}
        derived: dict[int, int] = {}
        self._isolated_state = set()
        inputs = self._input_storages(node)
        state_storages = self._state_storages | self._isolated_state

        def pack(tensor: torch.Tensor) -> int:
            storage = storage_ptr(tensor)
            if storage not in state_storages:
                key = (storage, tensor.storage_offset() if storage is not None else id(tensor),
                       tuple(tensor.shape), tensor.dtype)
                packed[key] = (storage, tensor.numel() * tensor.element_size(), tensor.dtype)
            # Keep only a size, never the tensor: a packed output that refers back to
            # its own grad_fn makes a C++ reference cycle that the gc cannot free.
            return 0

        def unpack(_: int) -> torch.Tensor:
            raise RuntimeError("the saved-bytes pass never runs backward")

        def on_derived(copy: torch.Tensor, source: torch.Tensor) -> None:
            copy_storage, source_storage = storage_ptr(copy), storage_ptr(source)
            if copy_storage is not None and source_storage is not None:
                derived[copy_storage] = source_storage

        with saved_tensors_hooks(pack, unpack), record_derivations(on_derived):
            outputs = [t for t in tree_flatten(run())[0] if isinstance(t, torch.Tensor)]
        output_storages = {storage_ptr(t) for t in outputs} - {None}

        saved_from: dict[str, int] = {}
        saved_derived: dict[str, int] = {}
        internal = internal_bool = 0
        for storage, size, dtype in packed.values():
            if storage in inputs:
                source = inputs[storage][0]
                saved_from[source] = max(saved_from.get(source, 0), size)
            elif storage in derived and derived[storage] in inputs:
                source = inputs[derived[storage]][0]
                saved_derived[source] = saved_derived.get(source, 0) + size
            elif storage in output_storages:
                saved_from[node.name] = max(saved_from.get(node.name, 0), size)
            else:
                internal += size
                if dtype == torch.bool:
                    internal_bool += size
        alias_of, inplace = None, False
        for output in outputs[:1]:
            storage = storage_ptr(output)
            if storage in inputs:
                alias_of = inputs[storage][0]
                inplace = inputs[storage][2]._version != inputs[storage][1]
        node.meta[SAVED_KEY] = SavedTensors(
            bytes=int(sum(size for _, size, _ in packed.values())), tensors=len(packed), saved_from=saved_from,
            saved_derived=saved_derived, internal_bytes=internal, internal_bool_bytes=internal_bool,
            alias_of=alias_of, inplace=inplace)


def measure_saved_bytes(gm: torch.fx.GraphModule, *example_inputs, progress: bool = False) -> torch.fx.GraphModule:
    """Annotate every node with the bytes of activations it saves for backward, and their sources.

    Example::

        >>> measure_saved_bytes(gm, torch.randn(8, 3, 64, 64))
        >>> saved_of(gm.graph.find_nodes(op="call_module", target="conv1")[0]).bytes
    """
    for node in gm.graph.nodes:
        node.meta[SAVED_KEY] = SavedTensors()
    SavedBytesInterpreter(gm, progress=progress).run(*example_inputs)
    return gm
