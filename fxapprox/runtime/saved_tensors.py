"""What names a tensor autograd saves, and counting them: storage identity, memory layout, parameters left out.

Shared by the compressed-saving runtime (:mod:`fxapprox.runtime.saved_activations`), the planning passes that measure
saved bytes, and :class:`count_saved_bytes`, the user-facing counter.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["EAGER_COPY_BITS", "count_saved_bytes", "eager_copy_eligible", "is_dense", "memory_order", "memory_row",
           "state_storages", "storage_ptr", "tensor_key"]

#: the bits of the copies eager code's saved tensors keep, when the memory plan copies them (no measurement picks
#: them per tensor: eager code has no graph; attention's q, k and v are among them, which keep at least 8 bits)
EAGER_COPY_BITS = 8
#: autograd nodes whose backward exponentiates their saved output (probabilities rebuilt from a softmax's or
#: log-softmax's result): an error in the copy is multiplied through ``exp``
_EXPONENTIATED_OUTPUTS = ("SoftmaxBackward", "LogSoftmaxBackward")


def storage_ptr(tensor: torch.Tensor) -> int | None:
    """Address of ``tensor``'s storage (``None`` for mkldnn/sparse tensors, which have no plain storage)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers a gap-free, non-overlapping run of its storage (any order of dimensions:
    contiguous, channels-last, a transpose of a contiguous tensor)."""
    return _dense(tuple(tensor.shape), tuple(tensor.stride()))


def memory_row(shape, stride) -> int | None:
    """The feature row of a tensor of this geometry as :func:`memory_order` lays it out, which its packed copy's
    groups align to (:func:`fxapprox.ops.quantize.row_group`): the last dimension of a 2-d or 3-d tensor
    (a token's features), the channels of a dense 4-d or 5-d one whose channels are innermost (channels-last);
    ``None`` otherwise — a map's last dimension is a spatial row, and attention's heads are rows of a token's
    features, which groups span freely."""
    shape, stride = tuple(shape), tuple(stride)
    if len(shape) < 2:
        return None
    dense = _dense(shape, stride)
    innermost = next((index for index, (size, step) in enumerate(zip(shape, stride)) if size > 1 and step == 1),
                     len(shape) - 1) if dense else len(shape) - 1
    if len(shape) <= 3:
        return shape[innermost] if innermost == len(shape) - 1 else None
    return shape[1] if innermost == 1 else None


def _dense(shape: tuple, strides: tuple) -> bool:
    span = 1
    for size, stride in zip(shape, strides):
        if size > 1:
            if stride <= 0:
                return False
            span += (size - 1) * stride
    numel = 1
    for size in shape:
        numel *= size
    if span != numel:
        return False
    # A gap-free span of numel elements with no overlap: the strides, sorted, must be the running products.
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(shape, strides) if s > 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def eager_copy_eligible(tensor: torch.Tensor, min_bytes: int) -> bool:
    """Whether a tensor eager code saves may be kept as a copy: floating point, at least ``min_bytes``, made by an
    op autograd records (a kernel's non-differentiable outputs — attention's log-sum-exp, whose error its backward
    exponentiates — and constants such as rotary tables stay as they are), and not a softmax's output."""
    if not tensor.is_floating_point() or tensor.grad_fn is None or tensor.numel() * tensor.element_size() < min_bytes:
        return False
    return not type(tensor.grad_fn).__name__.startswith(_EXPONENTIATED_OUTPUTS)


def _layout(tensor: torch.Tensor):
    # Dense views of one run of memory (attention's output and the merged-heads view a projection saves) are
    # one tensor to the plan: they share a key, and so one copy, kept in memory order.
    if is_dense(tensor):
        return "dense"
    return (tuple(tensor.shape), tensor.stride())


def tensor_key(tensor: torch.Tensor, ptr: int) -> tuple:
    """What names one saved tensor: storage, offset, size, dtype, version and memory layout.

    Dense views of the same run of storage (any permutation of dimensions) share a key, so they share
    one copy.
    """
    return (ptr, tensor.storage_offset(), tensor.numel(), tensor.dtype, tensor._version, _layout(tensor))


def memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D run of storage a dense tensor covers (a view), or its elements in logical order (a copy)."""
    if is_dense(tensor):
        return tensor.as_strided((tensor.numel(),), (1,))
    return tensor.reshape(-1)


def state_storages(module: torch.nn.Module) -> set[int]:
    """Storage pointers of a module's parameters and buffers (kept as they are, not counted)."""
    pointers = {storage_ptr(t) for t in list(module.parameters()) + list(module.buffers())}
    pointers.discard(None)
    return pointers


class count_saved_bytes:  # noqa: N801 — used like a function: ``with count_saved_bytes(model) as c``
    """Count the distinct bytes autograd saves for backward inside the block (parameters left out).

    Example::

        >>> with fxapprox.count_saved_bytes(model) as counter:
        ...     loss = model(x).sum()
        >>> counter.bytes
    """

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self._state = state_storages(module) if module is not None else set()
        self._seen: dict[tuple, int] = {}
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        ptr = storage_ptr(tensor)
        if ptr is not None and ptr not in self._state:
            self._seen[tensor_key(tensor, ptr)] = tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    def __enter__(self) -> "count_saved_bytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
