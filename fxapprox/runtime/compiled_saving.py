"""Compressed saving under ``torch.compile``: the memory plan's low-bit copies made inside the compiled graphs.

Eagerly, the compressor (:mod:`fxapprox.runtime.saved_activations`) tags graph values and packs what autograd
saves from them in Python hooks. Under ``torch.compile`` the compiler decides what the backward keeps (its
partitioner recomputes cheap ops and saves others), so the plan's values are not the saved tensors. Instead
the training forward runs inside ``saved_tensors_hooks`` whose pack and unpack are ``torch.fx.GraphModule``s:
AOTAutograd inlines such hooks (``torch._functorch._aot_autograd.graph_compile.
maybe_inline_graph_saved_tensors_hooks``) — the pack into the forward graph after each saved intermediate, the
unpack into the backward graph before its first use — so inductor fuses the quantisation into the producer's
epilogue and the dequantisation into the consumer's prologue: no extra pass over memory, no Python per tensor.

The width of a saved tensor is the plan's: the widest width the memory plan gives a value of the same size, last
dimension and dtype (a value the plan rebuilds from another's copy at that copy's width). The compiler saves views
of the plan's values (``(2048, 1024)`` for a ``(16, 128, 1024)`` value) and sometimes a value's producer instead
of the value (a GELU's input), so the match is by size; the widest keeps every width floor (attention's inputs).
Tensors of no planned size stay exact, as do views (attention's heads: their base stays alive through the other
views, so a copy only adds to the peak). The copy is the eager packer's format — groups of
``activation_group_size`` elements in memory order, one offset and step per group, codes packed ``8 // bits`` to a
byte — with unbiased stochastic rounding (an ordered dither: a fixed pattern over a group's positions shifted by
one uniform number per group, drawn with inductor's own random op so it fuses) or nearest rounding. A group whose
least value is exactly zero (a ReLU's output) is sign-exact, as the eager packer makes a ReLU's copy: its zeros
stay zeros and its positives positive.

The hooks' pack and unpack are one ``torch.fx.wrap``'d call each (traced per saved tensor at compile time, where
its shape is known); the call names the widths by a key, which is also the AOTAutograd cache hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx

from fxapprox.ops.quantize import row_group
from fxapprox.runtime.saved_tensors import memory_row

__all__ = ["CompiledSaving", "compiled_widths", "pack_saved", "unpack_saved"]

#: the fixed pattern of the dither: position j of a group gets frac(j · golden ratio)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class CompiledSaving:
    """The widths of saved tensors under ``torch.compile``, and how to pack them."""

    #: ``(numel, last dimension, dtype, bits)`` of each compressed value of the plan
    widths: tuple[tuple[int, int, str, int], ...]
    group_size: int = 256
    min_bytes: int = 65536
    stochastic: bool = True

    @property
    def key(self) -> str:
        """A digest of everything that decides the packed copy (the registry key and the compile cache hash)."""
        text = repr((self.widths, self.group_size, self.min_bytes, self.stochastic, _SOURCE_DIGEST))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def bits_for(self, tensor: torch.Tensor) -> int | None:
        """The width ``tensor`` is saved at, or ``None`` to keep it as it is."""
        if not tensor.is_floating_point() or tensor.numel() * tensor.element_size() < max(self.min_bytes, 1):
            return None
        dtype = str(tensor.dtype).replace("torch.", "")
        last = tensor.shape[-1] if tensor.dim() else 1
        found = [bits for numel, size, kind, bits in self.widths
                 if kind == dtype and numel == tensor.numel() and size == last]
        return max(found) if found else None

    @contextlib.contextmanager
    def hooks(self):
        """``saved_tensors_hooks`` with this saving's inlinable pack and unpack (the same objects every call:
        dynamo guards on their identity, so new ones would recompile)."""
        pack, unpack = _hook_modules(self)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


#: this module's own code: a change of the packer is a change of every cache key
_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
_REGISTRY: dict[str, CompiledSaving] = {}
_HOOKS: dict[str, tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}


def compiled_widths(memory_plan, config) -> CompiledSaving:
    """The :class:`CompiledSaving` of ``memory_plan`` (a :class:`fxapprox.plan.MemoryPlan`) under ``config``."""
    by_node = {d.node: d for d in memory_plan.values}

    def stored_bits(decision) -> int:
        # a value the plan rebuilds from another's copy is as approximate as that copy; the compiler, which
        # rebuilds what it chooses, may save the value itself: at the copy's width
        seen = set()
        while decision.recomputed_from is not None and decision.node not in seen:
            seen.add(decision.node)
            decision = by_node.get(decision.recomputed_from, decision)
        return decision.bits if decision.compressed else 32

    widths = set()
    for decision in memory_plan.values:
        if decision.shape is None or not (decision.compressed or decision.recomputed_from is not None):
            continue
        bits = stored_bits(decision)
        if 1 < bits < 16:
            widths.add((math.prod(decision.shape), decision.shape[-1] if decision.shape else 1, decision.dtype, bits))
    widths = sorted(widths)
    return CompiledSaving(tuple(widths), config.activation_group_size, config.activation_min_bytes,
                          config.activation_rounding == "stochastic")


def _dither(groups: int, group_size: int, device: torch.device) -> torch.Tensor:
    from torch._inductor import inductor_prims   # its random op has a lowering inductor fuses, and an eager one

    column = torch.frac(torch.arange(group_size, device=device, dtype=torch.float32) * _GOLDEN)
    seed = inductor_prims.lookup_seed(inductor_prims.seeds(1, device), 0)
    shift = inductor_prims.random([groups, 1], seed, "rand")
    return torch.frac(column[None, :] + shift)


@torch.fx.wrap
def pack_saved(tensor: torch.Tensor, key: str):
    """The pack hook's body: ``tensor`` as a low-bit copy (a tuple), or ``tensor`` itself."""
    saving = _REGISTRY[key]
    bits = saving.bits_for(tensor)
    # A view (attention's transposed heads) stays as it is: its base is alive through the other views, and a
    # copy of the view would add to it (measured: the step's peak grew)
    if bits is None or not tensor.is_contiguous() or tensor.numel() == 0:
        return tensor
    flat = tensor.reshape(-1)
    numel = flat.numel()
    size = row_group(saving.group_size, memory_row(tensor.shape, tensor.stride()))   # groups within feature rows
    pad = -numel % size
    if pad:   # the tail group padded with its own last value, so it does not widen the range
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    groups = flat.view(-1, size).float()
    levels = (1 << bits) - 1
    lo = groups.amin(dim=1, keepdim=True)
    hi = groups.amax(dim=1, keepdim=True)
    # A group whose least value is exactly 0 (a ReLU's output, as the compiler may save it) is sign-exact, as the
    # eager packer's sign_exact: code 0 for its zeros only, its positives on codes 1… counting from 0, so a
    # backward that asks ``value > 0`` reads the exact mask. Its step is stored negated to say so.
    signed = lo == 0
    step = torch.where(signed, hi / (levels - 1), (hi - lo) / levels)
    step = torch.where(step > 0, step, torch.ones_like(step))   # a constant group: every code 0, exact
    shifted = (groups - lo) / step
    shifted = shifted + (_dither(groups.shape[0], size, groups.device) if saving.stochastic else 0.5)
    codes = torch.minimum(torch.floor(shifted).clamp(min=0), levels - signed.to(torch.float32))
    codes = torch.where(signed & (groups > 0), codes + 1, codes).to(torch.uint8)
    step = torch.where(signed, -step, step)
    per_byte = 8 // bits
    if per_byte > 1:   # planar, as the eager packer: byte j holds codes j, j + size/per_byte, …
        parts = codes.view(codes.shape[0], per_byte, size // per_byte)
        packed = parts[:, 0]
        for slot in range(1, per_byte):
            packed = packed | (parts[:, slot] << (slot * bits))
        codes = packed
    return codes, lo, step, bits, numel, tuple(tensor.shape), tensor.dtype


@torch.fx.wrap
def unpack_saved(packed):
    """The unpack hook's body: the tensor back from :func:`pack_saved`'s copy."""
    if isinstance(packed, torch.Tensor):
        return packed
    codes, lo, step, bits, numel, shape, dtype = packed
    per_byte = 8 // bits
    if per_byte > 1:
        # one pointwise expression per element (code j sits in byte j mod width, at bit bits·(j div width)):
        # inductor fuses it with the dequantisation into one kernel, where a stack of slices is a kernel per slot
        groups, width = codes.shape
        size = width * per_byte
        shifts = (torch.arange(size, device=codes.device) // width * bits).to(torch.uint8)
        spread = codes.unsqueeze(1).expand(groups, per_byte, width).reshape(groups, size)
        codes = (spread >> shifts) & ((1 << bits) - 1)
    codes = codes.float()
    signed = step < 0
    step = step.abs()
    # a sign-exact group: code c is (c - 1)·step, a positive that rounded to 0 (code 1) a tiny positive — far
    # below the step, far above subnormals (their products are slow on x86); an affine group: lo + c·step
    values = torch.where(signed, torch.relu(codes - 1) * step, codes * step + lo)
    values = torch.where(signed & (codes == 1), torch.clamp(step * 2.0 ** -24, min=1e-30), values)
    values = values.reshape(-1)[:numel]
    return values.to(dtype).view(shape)


def _hook_modules(saving: CompiledSaving) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    key = saving.key
    if key not in _HOOKS:
        _REGISTRY[key] = saving
        pack = torch.fx.symbolic_trace(_PackHook(key))
        unpack = torch.fx.symbolic_trace(_UnpackHook())
        for gm in (pack, unpack):
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    # an fx.wrap'd call is opaque to AOTAutograd's cache: it caches under the hash given here
                    node.meta["user_cache_hash"] = key
        _HOOKS[key] = (pack, unpack)
    return _HOOKS[key]


class _PackHook(torch.nn.Module):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def forward(self, tensor):
        return pack_saved(tensor, self.key)


class _UnpackHook(torch.nn.Module):
    def forward(self, packed):
        return unpack_saved(packed)
