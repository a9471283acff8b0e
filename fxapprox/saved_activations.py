"""Runtime of compressed activation saving: exact forward, low-bit copies kept for backward.

The memory rewrite pass (``fxapprox.passes.rewrite_saved``) inserts, after each
planned graph value, a node ``compress_saved(value, bits, sign_exact)``. While an
:class:`ApproxGraphModule` trains, its forward runs inside one
:class:`SavedTensorCompressor` session, which is a pair of
``torch.autograd.graph.saved_tensors_hooks``:

* ``compress_saved`` *tags* the value's storage with its bit width;
* every tensor autograd saves from a tagged storage is packed
  (:mod:`fxapprox.ops.quantize`) — once: a second save of the same tensor, a
  view of it or an alias (``x * x``, ReLU's result and the next conv's input)
  reuses the first copy;
* a tensor saved *before* its tag (a ReLU saving its own result) waits as a
  pending handle and is packed when the tag arrives;
* untagged tensors (parameters, small or exact-planned values) are kept as they
  are; boolean tensors (dropout masks) are bit-packed losslessly.

Unpacking rebuilds a tensor each time it is asked (``retain_graph=True`` works);
double backward through a compressed copy is refused with a clear error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from fxapprox.ops._derived import local as _local
from fxapprox.ops._derived import note_derived, record_derivations
from fxapprox.ops.quantize import FLOAT_DTYPES, QuantizedTensor, pack_mask, quantize


def storage_ptr(tensor: torch.Tensor) -> int | None:
    """Address of ``tensor``'s storage (``None`` for mkldnn/sparse tensors, which have no plain storage)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _layout(tensor: torch.Tensor):
    if tensor.is_contiguous():
        return "c"
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    return (tuple(tensor.shape), tensor.stride())


def tensor_key(tensor: torch.Tensor, ptr: int) -> tuple:
    """What names one saved tensor: storage, offset, size, dtype, version and memory layout.

    Views with the same storage, offset, size and layout share a key (``flatten`` of a
    contiguous tensor), so they share one copy.
    """
    return (ptr, tensor.storage_offset(), tensor.numel(), tensor.dtype, tensor._version, _layout(tensor))


@dataclass(frozen=True)
class SavedActivationStats:
    """What one training forward kept for backward (distinct tensors, parameters left out)."""

    exact_bytes: int    #: bytes the same tensors take uncompressed
    stored_bytes: int   #: bytes actually kept (compressed copies + tensors kept as they are)
    packed_tensors: int
    kept_tensors: int

    @property
    def ratio(self) -> float:
        """``exact_bytes / stored_bytes`` (how many times fewer bytes)."""
        return self.exact_bytes / self.stored_bytes if self.stored_bytes else 1.0


class _Handle:
    """What the pack hook returns: a tensor kept as is, or a shared compressed copy."""

    __slots__ = ("tensor", "copy", "shape")

    def __init__(self, tensor: torch.Tensor | None, copy: QuantizedTensor | None, shape: torch.Size) -> None:
        self.tensor = tensor
        self.copy = copy
        self.shape = shape

    def unpack(self) -> torch.Tensor:
        if self.copy is None:
            return self.tensor
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fxapprox: double backward (create_graph=True) through activations saved compressed is not "
                "supported; approximate the model with memory_budget=None for higher-order gradients")
        # Rebuilt on every unpack and never cached: a tensor saved by several nodes is rebuilt for
        # each, which costs a pass but keeps backward's peak low (holding rebuilt tensors for the
        # next saver measured 20% less batch under a memory cap).
        return self.copy.dequantize().view(self.shape)


@dataclass(frozen=True)
class SavingOptions:
    """How tagged tensors are packed (from :class:`fxapprox.ApproxConfig`)."""

    group_size: int = 256
    rounding: str = "stochastic"
    compiled: bool = True


class SavedTensorCompressor:
    """One training forward's pack/unpack hooks; see the module docstring."""

    def __init__(self, options: SavingOptions, state_storages: set[int]) -> None:
        self.options = options
        self.state_storages = state_storages
        self._tags: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self._pending: dict[int, list[tuple[_Handle, torch.Tensor, tuple, StorageWeakRef]]] = {}
        self._copies: dict[tuple, tuple[StorageWeakRef, QuantizedTensor]] = {}
        # Accounting. Keys name a tensor only while its storage lives (a freed address is reused),
        # so each entry keeps a weak reference and a dead entry counts as a new tensor.
        self._seen: dict[tuple, StorageWeakRef] = {}
        self._kept: dict[tuple, int] = {}
        self.exact_bytes = 0
        self.kept_bytes = 0
        self.packed_bytes = 0
        self.packed_tensors = 0

    # -- tagging ----------------------------------------------------------
    def tag(self, value, bits: int, sign_exact: bool) -> None:
        if not isinstance(value, torch.Tensor):
            return
        ptr = storage_ptr(value)
        if ptr is None or ptr in self.state_storages:
            return
        self._tags[ptr] = (StorageWeakRef(value.untyped_storage()), bits, sign_exact)
        for handle, tensor, key, storage in self._pending.pop(ptr, ()):
            self._compress_into(handle, tensor, key, storage, bits, sign_exact)

    def tag_like(self, derived: torch.Tensor, source: torch.Tensor) -> None:
        """Give ``derived`` (e.g. the gathered columns a sampled op saves) the tag of ``source``."""
        tag = self._live_tag(storage_ptr(source))
        if tag is not None:
            self.tag(derived, tag[1], tag[2])

    def _live_tag(self, ptr):
        tag = self._tags.get(ptr)
        if tag is None or tag[0].expired():
            return None
        return tag

    # -- hooks ------------------------------------------------------------
    def pack(self, tensor: torch.Tensor):
        ptr = storage_ptr(tensor)
        if ptr is None or ptr in self.state_storages or tensor.numel() == 0:
            return _Handle(tensor, None, tensor.shape)
        key = tensor_key(tensor, ptr)
        seen = self._seen.get(key)
        if seen is None or seen.expired():
            seen = self._seen[key] = StorageWeakRef(tensor.untyped_storage())
            self.exact_bytes += tensor.numel() * tensor.element_size()
            self._kept.pop(key, None)
        handle = _Handle(tensor, None, tensor.shape)
        if tensor.dtype == torch.bool:
            self._compress_into(handle, tensor, key, seen, 1, False)
            return handle
        tag = self._live_tag(ptr)
        if tag is None:
            self._pending.setdefault(ptr, []).append((handle, tensor, key, seen))
            self._keep(key, tensor)
        else:
            self._compress_into(handle, tensor, key, seen, tag[1], tag[2])
        return handle

    def _keep(self, key: tuple, tensor: torch.Tensor) -> None:
        if key not in self._kept:
            self._kept[key] = tensor.numel() * tensor.element_size()
            self.kept_bytes += self._kept[key]

    @staticmethod
    def unpack(handle: _Handle) -> torch.Tensor:
        return handle.unpack()

    def _compress_into(self, handle: _Handle, tensor: torch.Tensor, key: tuple, storage: StorageWeakRef,
                       bits: int, sign_exact: bool) -> None:
        if bits >= 16 or (tensor.dtype not in FLOAT_DTYPES and tensor.dtype != torch.bool):
            self._keep(key, tensor)
            return
        if key in self._kept:  # a pending tensor, compressed now: no longer kept as is
            self.kept_bytes -= self._kept.pop(key)
        cache_key = key + (bits, sign_exact)
        cached = self._copies.get(cache_key)
        if cached is not None and not cached[0].expired():
            copy = cached[1]
        else:
            if bits == 1:
                copy = pack_mask(tensor)
            else:
                copy = quantize(tensor, bits, group_size=self.options.group_size, rounding=self.options.rounding,
                                sign_exact=sign_exact, compiled=self.options.compiled)
            self._copies[cache_key] = (storage, copy)
            self.packed_bytes += copy.nbytes
            self.packed_tensors += 1
        handle.tensor, handle.copy = None, copy

    # -- session ----------------------------------------------------------
    def stats(self) -> SavedActivationStats:
        return SavedActivationStats(exact_bytes=self.exact_bytes, stored_bytes=self.kept_bytes + self.packed_bytes,
                                    packed_tensors=self.packed_tensors, kept_tensors=len(self._kept))

    def close(self) -> None:
        self._tags.clear()
        self._pending.clear()
        self._copies.clear()
        self._seen.clear()


def _current() -> SavedTensorCompressor | None:
    return getattr(_local, "compressor", None)


def compress_saved(value, bits: int, sign_exact: bool = False) -> None:
    """Graph node inserted by the memory rewrite: save ``value`` for backward at ``bits`` bits.

    Does nothing outside a compressing training forward (eval, ``no_grad``,
    ``set_approximate(False)``).
    """
    compressor = _current()
    if compressor is not None:
        compressor.tag(value, bits, sign_exact)


# Not dead code to torch.fx: it has no users, but it must run where it stands.
torch.fx.node.has_side_effect(compress_saved)


def state_storages(module: torch.nn.Module) -> set[int]:
    """Storage pointers of a module's parameters and buffers (kept as they are, not counted)."""
    pointers = {storage_ptr(t) for t in list(module.parameters()) + list(module.buffers())}
    pointers.discard(None)
    return pointers


@contextlib.contextmanager
def compressing_saved_tensors(options: SavingOptions, module: torch.nn.Module):
    """Run the block with tagged saved tensors compressed; yields the :class:`SavedTensorCompressor`."""
    if _current() is not None:
        raise RuntimeError("fxapprox: compressed activation saving does not nest (a compressing module inside "
                           "another); approximate the outer model only")
    compressor = SavedTensorCompressor(options, state_storages(module))
    _local.compressor = compressor
    try:
        with saved_tensors_hooks(compressor.pack, compressor.unpack):
            yield compressor
    finally:
        _local.compressor = None
        compressor.close()


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


__all__ = ["SavedActivationStats", "SavedTensorCompressor", "SavingOptions", "compress_saved",
           "compressing_saved_tensors", "count_saved_bytes", "note_derived", "record_derivations", "state_storages",
           "storage_ptr", "tensor_key"]
