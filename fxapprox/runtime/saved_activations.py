"""Runtime of compressed activation saving: exact forward, low-bit copies kept for backward.

The memory rewrite pass (``fxapprox.passes.memory.rewrite_saved``) inserts, after each
planned graph value, a marker node ``compress_saved(value, bits, sign_exact)``
(:mod:`fxapprox.runtime.saved_markers`). While an
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
  are; boolean tensors (dropout masks) are bit-packed losslessly;
* ``recompute_saved(value, source, recipe, args, kwargs)`` (inserted after a
  LayerNorm, GELU and the like whose input is saved anyway) marks the value as
  *rebuilt in backward*: what autograd saves from it keeps nothing but a
  reference to the source's saved copy and re-runs the op on it when unpacked
  (see :data:`RECOMPUTABLE_FUNCTIONS`).

Unpacking rebuilds a tensor each time it is asked (``retain_graph=True`` works);
double backward through a compressed copy is refused with a clear error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from fxapprox.ops.quantize import FLOAT_DTYPES, QuantizedTensor, pack_mask, quantize
from fxapprox.ops.training_context import current, note_derived, record_derivations, training_context
from fxapprox.runtime.recompute import (RECOMPUTABLE_FUNCTIONS, RECOMPUTABLE_METHODS, RECOMPUTABLE_MODULES,
                                        RecomputedCopy)
from fxapprox.runtime.saved_tensors import (count_saved_bytes, eager_copy_eligible, is_dense, memory_order,
                                            memory_row, state_storages, storage_ptr, tensor_key)

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
    """What the pack hook returns: a tensor kept as is, or a shared compressed copy (of its memory-order run)."""

    __slots__ = ("tensor", "copy", "shape", "stride")

    def __init__(self, tensor: torch.Tensor | None, copy, shape: torch.Size) -> None:
        self.tensor = tensor
        self.copy = copy
        self.shape = shape
        self.stride = tuple(tensor.stride()) if tensor is not None and is_dense(tensor) else None

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
        rebuilt = self.copy.dequantize()
        if isinstance(self.copy, QuantizedTensor) and self.stride is not None:
            return rebuilt.as_strided(self.shape, self.stride)
        return rebuilt.view(self.shape)


def _geometry(tensor: torch.Tensor) -> tuple:
    return (tensor.shape, tuple(tensor.stride()), tensor.storage_offset())


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
        self._recipes: dict[int, tuple[StorageWeakRef, tuple]] = {}
        # the modules of a region-captured model running (innermost last): (bits, min bytes, their pending, owner)
        # for eager code whose saves are kept as copies, ``(None, 0, [], owner)`` for a region
        self._eager_scopes: list[tuple[int | None, int, list, object]] = []
        self._region_saved: dict[int, StorageWeakRef] = {}   # storages a region saved (its plan decides them)
        # Accounting. Keys name a tensor only while its storage lives (a freed address is reused),
        # so each entry keeps a weak reference and a dead entry counts as a new tensor.
        self._seen: dict[tuple, StorageWeakRef] = {}
        self._kept: dict[tuple, int] = {}
        self.exact_bytes = 0
        self.kept_bytes = 0
        self.packed_bytes = 0
        self.packed_tensors = 0

    # -- tagging ----------------------------------------------------------
    def tag(self, value, bits: int, sign_exact: bool, row: int | None | bool = True) -> None:
        """``value``'s saves are packed at ``bits``; their groups align to ``row`` (``True``: ``value``'s own row, the
        one the plan counted, whichever view of it autograd saves; ``None``: no alignment)."""
        if not isinstance(value, torch.Tensor):
            return
        ptr = storage_ptr(value)
        if ptr is None or ptr in self.state_storages:
            return
        if row is True:
            row = memory_row(value.shape, value.stride())
        self._tags[ptr] = (StorageWeakRef(value.untyped_storage()), bits, sign_exact, row)
        for handle, tensor, key, storage in self._pending.pop(ptr, ()):
            self._compress_into(handle, tensor, key, storage, bits, sign_exact, row)

    def tag_recompute(self, value, source, recipe, args: tuple, kwargs: dict) -> None:
        """Mark ``value`` (``= recipe(*args, **kwargs)``, ``source`` among the arguments) as rebuilt in backward."""
        if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
            return
        ptr = storage_ptr(value)
        if ptr is None or ptr in self.state_storages:
            return
        slot = next((i for i, a in enumerate(args) if a is source), None)
        if slot is None:
            slot = next(k for k, a in kwargs.items() if a is source)
        args = tuple(None if i == slot else a for i, a in enumerate(args))
        kwargs = {k: (None if k == slot else a) for k, a in kwargs.items()}
        # The source's copy, made when one of its savers packed it (the plan only recomputes values whose
        # source is saved before them); a source kept exact is held as is (autograd holds it anyway).
        source_ptr = storage_ptr(source)
        chained = self._recipes.get(source_ptr)
        if chained is not None and not chained[0].expired():   # the source is rebuilt too: a chain
            copy = self._recomputed_copy(chained[1], source)
        else:
            key = tensor_key(source, source_ptr)
            copy = next((entry[1] for cache_key, entry in self._copies.items()
                         if cache_key[:len(key)] == key and not entry[0].expired()), None)
        source_shape = (source.shape, tuple(source.stride()) if is_dense(source) else None)
        device = value.device.type
        autocast = (device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        recipe_entry = (copy if copy is not None else source, source_shape, recipe, args, kwargs, slot,
                        _geometry(value), value.dtype, autocast)
        self._recipes[ptr] = (StorageWeakRef(value.untyped_storage()), recipe_entry)
        for handle, tensor, key, _ in self._pending.pop(ptr, ()):
            self._recompute_into(handle, tensor, key, recipe_entry)

    @staticmethod
    def _recomputed_copy(entry: tuple, tensor: torch.Tensor) -> RecomputedCopy:
        source, source_shape, recipe, args, kwargs, slot, base, dtype, autocast = entry
        return RecomputedCopy(source, source_shape, recipe, args, kwargs, slot, base, _geometry(tensor), dtype,
                              autocast)

    def _recompute_into(self, handle: _Handle, tensor: torch.Tensor, key: tuple, entry: tuple) -> None:
        if key in self._kept:
            self.kept_bytes -= self._kept.pop(key)
        handle.tensor = None
        handle.copy = self._recomputed_copy(entry, tensor)

    def tag_like(self, derived: torch.Tensor, source: torch.Tensor) -> None:
        """Give ``derived`` (e.g. the gathered columns a sampled op saves) the tag of ``source``."""
        tag = self._live_tag(storage_ptr(source))
        if tag is not None:
            self.tag(derived, tag[1], tag[2], None)   # a gathered copy: the plan counts it unaligned

    def follow_cast(self, cast: torch.Tensor, source: torch.Tensor) -> None:
        """``cast`` is autocast's lower-precision copy of ``source`` (what the op after it saves): give it
        ``source``'s compression, or rebuild it from ``source``'s rebuild."""
        ptr = storage_ptr(source)
        tag = self._live_tag(ptr)
        if tag is not None:
            self.tag(cast, tag[1], tag[2], tag[3])
            return
        recipe = self._recipes.get(ptr)
        if recipe is not None and not recipe[0].expired() and is_dense(source):
            self.tag_recompute(cast, source, _CastTo(cast.dtype), (source,), {})

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
            self._compress_into(handle, tensor, key, seen, 1, False, None)
            return handle
        recipe = self._recipes.get(ptr)
        if recipe is not None and not recipe[0].expired():
            self._recompute_into(handle, tensor, key, recipe[1])
            return handle
        tag = self._live_tag(ptr)
        if tag is None:
            entry = (handle, tensor, key, seen)
            self._pending.setdefault(ptr, []).append(entry)
            self._keep(key, tensor)
            if self._eager_scopes:
                if self._eager_scopes[-1][0] is None:
                    self._region_saved[ptr] = seen
                else:
                    self._eager_scopes[-1][2].append((ptr, entry))
        else:
            self._compress_into(handle, tensor, key, seen, tag[1], tag[2], tag[3])
        return handle

    def _keep(self, key: tuple, tensor: torch.Tensor) -> None:
        if key not in self._kept:
            self._kept[key] = tensor.numel() * tensor.element_size()
            self.kept_bytes += self._kept[key]

    @staticmethod
    def unpack(handle: _Handle) -> torch.Tensor:
        return handle.unpack()

    def _compress_into(self, handle: _Handle, tensor: torch.Tensor, key: tuple, storage: StorageWeakRef,
                       bits: int, sign_exact: bool, row: int | None) -> None:
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
            flat = memory_order(tensor)
            if bits == 1:
                copy = pack_mask(flat)
            else:
                copy = quantize(flat, bits, group_size=self.options.group_size, rounding=self.options.rounding,
                                row=row,
                                sign_exact=sign_exact, compiled=self.options.compiled)
            self._copies[cache_key] = (storage, copy)
            self.packed_bytes += copy.nbytes
            self.packed_tensors += 1
        handle.tensor, handle.copy = None, copy

    # -- eager code ------------------------------------------------------
    def enter_eager(self, bits: int | None, min_bytes: int, owner: object = None) -> None:
        """A module of a region-captured model starts. An eager one (``bits``): what its own code saves, and no
        region saves or tags by the time it ends, is kept as ``bits``-bit copies
        (:func:`~fxapprox.runtime.saved_tensors.eager_copy_eligible` decides which). A region (``None``): what it
        saves is its plan's. ``owner`` names the scope for :meth:`exit_eager`."""
        self._eager_scopes.append((bits, min_bytes, [], owner))

    def exit_eager(self, owner: object = None) -> None:
        """``owner``'s scope ends (and any left open inside it: a module that raised)."""
        index = next((i for i in range(len(self._eager_scopes) - 1, -1, -1)
                      if self._eager_scopes[i][3] is owner), None)
        if index is None:
            return
        while len(self._eager_scopes) > index:
            self._flush_eager(*self._eager_scopes.pop()[:3])

    def _flush_eager(self, bits: int | None, min_bytes: int, saved: list) -> None:
        for ptr, entry in saved:
            pending = self._pending.get(ptr, ())
            index = next((i for i, waiting in enumerate(pending) if waiting is entry), None)
            region = self._region_saved.get(ptr)
            if index is None or (region is not None and not region.expired()):
                continue   # a region saves it too: its plan decides it
            handle, tensor, key, storage = entry
            if not eager_copy_eligible(tensor, min_bytes):
                continue
            del pending[index]
            if not pending:
                del self._pending[ptr]
            self._compress_into(handle, tensor, key, storage, bits, False, memory_row(tensor.shape, tensor.stride()))

    # -- session ----------------------------------------------------------
    def stats(self) -> SavedActivationStats:
        return SavedActivationStats(exact_bytes=self.exact_bytes, stored_bytes=self.kept_bytes + self.packed_bytes,
                                    packed_tensors=self.packed_tensors, kept_tensors=len(self._kept))

    def close(self) -> None:
        self._tags.clear()
        self._pending.clear()
        self._copies.clear()
        self._recipes.clear()
        self._seen.clear()
        self._eager_scopes.clear()
        self._region_saved.clear()


class _CastTo:
    """The recipe that rebuilds autocast's cast of a rebuilt value."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype)


class _FollowAutocastCasts(TorchDispatchMode):
    """Under ``torch.autocast`` what a linear/conv/attention saves is not the graph value the plan tagged
    but autocast's bf16/fp16 cast of it, a new storage made inside the dispatcher, where no Python hook
    sees it (without this, a 0.125 memory plan stored 0.72 of the bytes under autocast). The casts do
    reach the Python dispatch key, below autocast: this mode follows them and hands each cast its source's
    compression. It runs only in a compressing forward under autocast: every op then pays one Python call.
    """

    _TO_COPY = torch.ops.aten._to_copy.default

    def __init__(self, compressor: SavedTensorCompressor) -> None:
        super().__init__()
        self.compressor = compressor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self._TO_COPY and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.compressor.follow_cast(out, args[0])
        return out


@contextlib.contextmanager
def without_cast_following():
    """Run the packer's own ops with :class:`_FollowAutocastCasts` off: they are not the model's (and under
    the mode the compiled packing kernels measured 3× slower)."""
    if isinstance(_get_current_dispatch_mode(), _FollowAutocastCasts):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


@contextlib.contextmanager
def compressing_saved_tensors(options: SavingOptions, module: torch.nn.Module):
    """Run the block with tagged saved tensors compressed; yields the :class:`SavedTensorCompressor`."""
    if current().compressor is not None:
        raise RuntimeError("fxapprox: compressed activation saving does not nest (a compressing module inside "
                           "another); approximate the outer model only")
    compressor = SavedTensorCompressor(options, state_storages(module))
    try:
        with training_context(compressor=compressor):
            if _autocast_on():
                def pack(tensor):
                    with without_cast_following():
                        return compressor.pack(tensor)

                with saved_tensors_hooks(pack, compressor.unpack), _FollowAutocastCasts(compressor):
                    yield compressor
            else:
                with saved_tensors_hooks(compressor.pack, compressor.unpack):
                    yield compressor
    finally:
        compressor.close()


__all__ = ["RECOMPUTABLE_FUNCTIONS", "RECOMPUTABLE_METHODS", "RECOMPUTABLE_MODULES", "RecomputedCopy",
           "SavedActivationStats", "SavedTensorCompressor", "SavingOptions", "compressing_saved_tensors",
           "count_saved_bytes", "note_derived", "record_derivations", "state_storages", "is_dense", "storage_ptr",
           "tensor_key", "without_cast_following"]
