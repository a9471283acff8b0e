"""Analysis of eager parts: the activations each eager module's own code makes autograd keep, in one real step.

The planning graph measures what traced regions and swapped leaves save, value by value, and the memory policy
chooses their widths. What eager code saves (Hugging Face's attention kernels, rotary embeddings, the loss inside
the model's forward) is not in that graph: it is counted here over a real forward, under
``torch.autograd.graph.saved_tensors_hooks`` with a stack of the regions running, and reported in the plan as kept
exact. A tensor that a region or leaf saves too (a projection's input that eager code saves as well) is the
region's: its width is planned there, and compressing it there compresses it for every saver.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from fxapprox.passes.capture.regions import Capture
from fxapprox.runtime.saved_tensors import state_storages, storage_ptr, tensor_key

__all__ = ["count_eager_saved_bytes"]


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


def count_eager_saved_bytes(model: nn.Module, capture: Capture, args: tuple, kwargs: dict) -> dict[str, int]:
    """``{eager module path: bytes}`` its own code saves for backward in one training forward of ``model``
    (parameters and buffers left out; each distinct tensor once, as :class:`fxapprox.count_saved_bytes` counts).
    Tensors that a traced region or swapped leaf also saves are left to the planning graph."""
    parameters = state_storages(model)
    stack: list = []
    owners: dict[tuple, set[str]] = {}
    sizes: dict[tuple, int] = {}
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
        sizes[key] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.enable_grad(), _region_stack(model, capture, stack), saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    counts: dict[str, int] = {}
    for key, paths in owners.items():
        if key[0] in captured_storages:
            continue
        path = min(paths, key=len)   # the outermost eager module that saved it
        counts[path] = counts.get(path, 0) + sizes[key]
    return counts
