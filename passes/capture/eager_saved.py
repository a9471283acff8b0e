"""Analysis of eager parts: the activations each eager module's own code makes autograd keep, in one real step.

The planning graph measures what traced regions and swapped leaves save, value by value, and the memory policy
chooses their widths. What eager code saves (Hugging Face's attention kernels, rotary embeddings, the loss inside
the model's forward) is not in that graph: it is counted here over a real forward, under
``torch.autograd.graph.saved_tensors_hooks`` with a stack of the regions running, and reported in the plan (kept
exact, or as copies when the budget needs them). A tensor that a region or leaf saves too (a projection's input that eager code saves as well) is the
region's: its width is planned there, and compressing it there compresses it for every saver.

Each eager module's count carries what its saves would take as copies (:data:`~fxapprox.runtime.saved_tensors.
EAGER_COPY_BITS`-bit, of the tensors :func:`~fxapprox.runtime.saved_tensors.eager_copy_eligible` admits): the memory
policy may keep them so (``fxapprox.runtime.saved_markers.EagerCopies`` does it at run time).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from fxapprox.passes.capture.regions import Capture
from fxapprox.ops.quantize import quantized_nbytes
from fxapprox.runtime.saved_tensors import (EAGER_COPY_BITS, eager_copy_eligible, memory_row, state_storages,
                                            storage_ptr, tensor_key)

__all__ = ["EagerSaved", "count_eager_saved_bytes"]


@dataclass(frozen=True)
class EagerSaved:
    """What one eager module's own code saves for backward in a training step."""

    exact_bytes: int    #: as autograd keeps them
    copied_bytes: int   #: with the eligible ones kept as ``EAGER_COPY_BITS``-bit copies, the rest as they are


@contextlib.contextmanager
def _region_stack(model: nn.Module, capture: Capture, stack: list):
    """Keeps ``stack`` the regions running, innermost last, while the block runs."""
    handles = []
    for region in capture.regions:
        module = model.get_submodule(region.path)

        def enter(_module, _args, _kwargs=None, region=region):
            stack.append(region)

        def leave(_module, _args, _output, region=region):
            if stack and stack[-1] is region:
                stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _common_owner(paths: set[str], eager_paths: set[str]) -> str:
    """The eager module a tensor several eager modules save is counted to: the innermost eager module all of them
    run inside (rotary tables that every layer's attention saves belong to the model, not to one layer, which the
    plan might checkpoint)."""
    if len(paths) == 1:
        return next(iter(paths))
    def inside(path: str, owner: str) -> bool:
        return owner == "" or path == owner or path.startswith(owner + ".")
    common = [owner for owner in eager_paths if all(inside(path, owner) for path in paths)]
    return max(common, key=len) if common else min(paths, key=lambda path: (len(path), path))


def count_eager_saved_bytes(model: nn.Module, capture: Capture, args: tuple, kwargs: dict, min_bytes: int,
                            group_size: int) -> dict[str, EagerSaved]:
    """``{eager module path: EagerSaved}``: what its own code saves for backward in one training forward of
    ``model`` (parameters and buffers left out; each distinct tensor once, as :class:`fxapprox.count_saved_bytes`
    counts), exact and as copies (``min_bytes``, ``group_size``: the memory config's). Tensors that a traced region
    or swapped leaf also saves are left to the planning graph."""
    parameters = state_storages(model)
    stack: list = []
    owners: dict[tuple, set[str]] = {}
    sizes: dict[tuple, tuple[int, int]] = {}
    captured_storages: set[int] = set()

    def pack(tensor: torch.Tensor):
        ptr = storage_ptr(tensor)
        if ptr is None or ptr in parameters or not stack:
            return tensor
        region = stack[-1]
        if region.kind != "eager":
            captured_storages.add(ptr)
            return tensor
        key = tensor_key(tensor, ptr)
        owners.setdefault(key, set()).add(region.path)
        exact = tensor.numel() * tensor.element_size()
        copied = (quantized_nbytes(tensor.numel(), EAGER_COPY_BITS, group_size,
                                   memory_row(tensor.shape, tensor.stride()))
                  if eager_copy_eligible(tensor, min_bytes) else exact)
        sizes.setdefault(key, (exact, min(exact, copied)))   # the first view saved: the one the runtime packs
        return tensor

    with torch.enable_grad(), _region_stack(model, capture, stack), saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    eager_paths = {region.path for region in capture.regions if region.kind == "eager"}
    counts: dict[str, tuple[int, int]] = {}
    for key, paths in owners.items():
        if key[0] in captured_storages:
            continue
        path = _common_owner(paths, eager_paths)
        exact, copied = counts.get(path, (0, 0))
        counts[path] = (exact + sizes[key][0], copied + sizes[key][1])
    return {path: EagerSaved(*pair) for path, pair in counts.items()}
