"""Low-bit copies of activations: per-group affine quantisation packed into bytes.

A float tensor is cut, in memory order, into groups of ``group_size`` elements;
each group keeps its minimum ``lo`` and step ``scale`` (bfloat16, rounded
outwards so every value stays inside ``[lo, lo + levels·scale]``) and one
``bits``-bit code per element, packed ``8 // bits`` to a byte. With
``bits=4`` and groups of 256 that is 4.125 bits per element.

* **Stochastic rounding** (default) rounds up with probability equal to the
  fractional part, so ``E[dequantize(quantize(x))] = x`` exactly: gradients
  computed from the copy are unbiased. The dither of element ``j`` of group
  ``g`` is ``frac(c_j + r_g)``: a fixed random pattern ``c`` over positions,
  shifted by a fresh uniform ``r_g`` per group and call (one ``torch.rand`` per
  *group*, from the global generator). Every element's dither is exactly
  uniform, so the rounding is unbiased; elements of one group share the shift
  (ordered dither). A per-element random number or integer hash measured 2–10×
  slower to pack on CPU.
* **Nearest rounding** is deterministic, error at most half a step.
* **Sign-exact** codes (``sign_exact=True``, for ReLU outputs) reserve code 0
  for exact zeros: the copy is zero exactly where the tensor is, so ReLU's
  backward, which only asks ``result > 0``, reads the same mask as from the
  exact tensor. Positive values use codes 1…levels for ``0, scale, 2·scale…``;
  code 1 (a positive value that rounded to 0) comes back as ``scale·2⁻²⁴`` (at
  least the dtype's smallest normal number), so its sign survives. Not the
  smallest normal number itself: products with it in the next layer's backward
  are subnormal, which x86 CPUs compute on a slow path — at 2 bits, where most
  small positives round to code 1, that made a ResNet-50 step 1.75× exact's
  instead of 1.13× (with subnormals flushed to zero).
* Boolean tensors (dropout masks) pack losslessly at 1 bit.
* NaN or ±inf in a group makes that group's copy non-finite: they propagate,
  never vanish. A constant group comes back exactly.

The element loops go through ``torch.compile`` (inductor) when ``compiled=True``
and a C++ compiler works; the same functions run eagerly otherwise.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

ROUNDINGS = ("stochastic", "nearest")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

def _bf16_toward(values: torch.Tensor, down: bool) -> torch.Tensor:
    """fp32 ``values`` rounded to bfloat16-representable numbers towards -inf (``down``) or +inf.

    Bit arithmetic rather than ``torch.nextafter`` so that inductor fuses it with the
    group reductions: dropping the low 16 bits rounds towards zero, and one more
    unit of the kept bits rounds away from it.
    """
    raw = values.view(torch.int32)
    toward_zero = raw & -65536
    away = toward_zero + 65536
    inexact = (raw & 65535) != 0
    wrong_side = (values < 0) if down else (values > 0)
    return torch.where(wrong_side & inexact, away, toward_zero).view(torch.float32)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) uint8 codes < 2**bits → (rows, cols*bits/8) bytes.

    Planar: byte ``j`` of a row holds codes ``j``, ``j + cols/per_byte``, … — every
    operand is a contiguous slice, which the compiler vectorises (interleaved
    pairs measured 5× slower).
    """
    if bits == 8:
        return codes
    per_byte = 8 // bits
    rows, cols = codes.shape
    parts = codes.view(rows, per_byte, cols // per_byte)
    packed = parts[:, 0]
    for slot in range(1, per_byte):
        packed = packed | (parts[:, slot] << (slot * bits))
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    rows, cols = packed.shape
    parts = [(packed >> (slot * bits)) & mask for slot in range(per_byte)]
    return torch.stack(parts, dim=1).view(rows, cols * per_byte)


def _encode(groups: torch.Tensor, column_noise: torch.Tensor, row_noise: torch.Tensor, bits: int,
            stochastic: bool, sign_exact: bool):
    levels = (1 << bits) - 1
    span = levels - 1 if sign_exact else levels
    x = groups.to(torch.float32)
    hi = x.amax(dim=1)
    lo = torch.zeros_like(hi) if sign_exact else _bf16_toward(x.amin(dim=1), down=True)
    step = (hi - lo) / span
    # A constant group (step 0) keeps any positive step: every code is then 0 and the value exact.
    step = torch.where(step > 0, step, 1.0)
    scale = _bf16_toward(step, down=False)
    t = (x - lo[:, None]) / scale[:, None]
    if stochastic:
        dither = column_noise[None, :] + row_noise[:, None]
        t = t + (dither - torch.floor(dither))
    else:
        t = t + 0.5
    codes = torch.floor(t).clamp(0, span)
    if sign_exact:
        codes = torch.where(x > 0, codes + 1, 0.0)
    return _pack_codes(codes.to(torch.uint8), bits), lo.to(torch.bfloat16), scale.to(torch.bfloat16)


def _decode(packed: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, sign_exact: bool,
            dtype: torch.dtype) -> torch.Tensor:
    codes = _unpack_codes(packed, bits).to(torch.float32)
    scale32 = scale.to(torch.float32)[:, None]
    if sign_exact:
        # A rounding-to-zero positive: far below the step (a bias of at most scale·2⁻²⁴), far above subnormals.
        positive_zero = torch.clamp(scale32 * 2.0 ** -24, min=torch.finfo(dtype).tiny)
        values = torch.relu(codes - 1) * scale32 + (codes == 1).to(torch.float32) * positive_zero
    else:
        values = lo.to(torch.float32)[:, None] + codes * scale32
    return values.to(dtype)


@functools.lru_cache(maxsize=None)
def _kernels(compiled: bool):
    if not compiled:
        return _encode, _decode
    try:
        # Static shapes except the number of groups (marked dynamic in _run): with the group size known
        # the per-group loops are fixed-length vector loops; all dynamic, packing measured 4.5 → 6.2 ms for
        # a 16×256×40×40 tensor (4 bits).
        encode = torch.compile(_encode, dynamic=False)
        decode = torch.compile(_decode, dynamic=False)
    except Exception as error:  # pragma: no cover - depends on the installation
        warnings.warn(f"fxapprox: torch.compile is unavailable ({error}); packing activations eagerly",
                      RuntimeWarning, stacklevel=3)
        return _encode, _decode
    return encode, decode


_compile_failed: dict[str, str] = {}


def _run(kind: str, compiled: bool, *args):
    """Run the compiled kernel, or the eager one if compilation fails once (with a warning)."""
    index = 0 if kind == "encode" else 1
    if compiled and not _compile_failed:
        try:
            # the number of groups varies with the tensor (marked dynamic); a group size (a value's row) compiles
            # kernels of its own
            per_group = (args[0], args[2]) if kind == "encode" else args[:3]
            for tensor in per_group:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            with torch.no_grad():  # one grad mode: packing (forward) and unpacking (backward) share kernels
                return _kernels(True)[index](*args)
        except Exception as error:
            # Only compiler failures (no C++ toolchain, an unsupported op) fall back; running out of
            # memory or a bad input inside a compiled kernel is the caller's error, raised as is.
            if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            _compile_failed[kind] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"fxapprox: compiling the activation packer failed ({_compile_failed[kind]}); "
                          "packing eagerly from now on (slower, same results)", RuntimeWarning, stacklevel=3)
    return _kernels(False)[index](*args)


@functools.lru_cache(maxsize=None)
def _column_noise(group_size: int, device) -> torch.Tensor:
    """A fixed random pattern over a group's positions (the dither's ordered part)."""
    generator = torch.Generator().manual_seed(0x5EED + group_size)
    return torch.rand(group_size, generator=generator).to(device)


@dataclass
class QuantizedTensor:
    """A packed low-bit copy of a tensor; :meth:`dequantize` rebuilds an approximate tensor."""

    packed: torch.Tensor           # uint8 codes, (groups, group_size*bits/8)
    lo: torch.Tensor | None        # bf16 per group
    scale: torch.Tensor | None     # bf16 per group
    bits: int
    numel: int
    shape: torch.Size
    dtype: torch.dtype
    channels_last: bool
    sign_exact: bool
    compiled: bool

    @property
    def nbytes(self) -> int:
        """Bytes this copy occupies (codes and group parameters)."""
        total = self.packed.numel() * self.packed.element_size()
        for extra in (self.lo, self.scale):
            if extra is not None:
                total += extra.numel() * extra.element_size()
        return total

    def dequantize(self) -> torch.Tensor:
        if self.bits == 1:
            flat = _unpack_bits(self.packed, self.numel)
            flat = flat if self.dtype == torch.bool else flat.to(self.dtype)
        else:
            values = _run("decode", self.compiled, self.packed, self.lo, self.scale, self.bits, self.sign_exact,
                          self.dtype)
            flat = values.reshape(-1)[: self.numel]
        return _restore_layout(flat, self.shape, self.channels_last)


#: the smallest group a row-aligned group may be (below it, 4 bytes of offset and step per group cost too much)
MIN_ROW_GROUP = 64


def row_group(group_size: int, row: int | None) -> int:
    """The group size a tensor whose rows (innermost memory dimension) hold ``row`` elements is packed with, so
    that no group spans two rows: a row of zeros — a padding token's embedding — comes back exactly zero, and a
    row far smaller than its neighbours keeps its own scale (a normalisation's backward multiplies by the row's
    own ``rsqrt`` cubed). ``group_size`` when it divides the row; a longer row's smallest divisor above
    ``group_size``, up to four times it (a 384-wide row is one group, fewer bytes than groups of 256); a shorter
    row itself, if at least :data:`MIN_ROW_GROUP`; all a multiple of 8. Otherwise (or ``row`` unknown)
    ``group_size``."""
    if not row or row % group_size == 0:
        return group_size
    if row > group_size:
        return next((size for size in range(group_size + 8, min(row, 4 * group_size) + 1, 8) if row % size == 0),
                    group_size)
    return row if row % 8 == 0 and row >= MIN_ROW_GROUP else group_size


def _flattened_row(tensor: torch.Tensor) -> int | None:
    """The feature row of ``tensor`` as :func:`_memory_order_flat` lays it out — logical order, or channels-last
    — for a tensor passed whole (the compressor passes the row of its own memory-order copy): the last dimension
    of a 2-d or 3-d tensor, the channels of a channels-last map, else ``None``."""
    if tensor.dim() < 2:
        return None
    if tensor.dim() <= 3:
        return tensor.shape[-1]
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.shape[1]
    return None


def _memory_order_flat(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``tensor`` in memory order (a copy only for odd strides) and whether it is NHWC."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.permute(0, 2, 3, 1).reshape(-1), True
    return tensor.reshape(-1), False


def _restore_layout(flat: torch.Tensor, shape: torch.Size, channels_last: bool) -> torch.Tensor:
    if channels_last:
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)


def _pack_bits(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat.to(torch.uint8)
    return _pack_codes(padded.view(1, -1), 1)


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return _unpack_codes(packed, 1).reshape(-1)[:numel].to(torch.bool)


def pack_mask(tensor: torch.Tensor) -> QuantizedTensor:
    """A lossless 1-bit copy of a boolean tensor (or of ``tensor > 0`` for a float tensor, which
    :meth:`QuantizedTensor.dequantize` returns as 0/1 in the tensor's dtype)."""
    flat, channels_last = _memory_order_flat(tensor)
    bits = flat if tensor.dtype == torch.bool else flat > 0
    return QuantizedTensor(_pack_bits(bits), None, None, 1, tensor.numel(), tensor.shape, tensor.dtype,
                           channels_last, False, False)


def quantize(tensor: torch.Tensor, bits: int, *, group_size: int = 256, rounding: str = "stochastic",
             sign_exact: bool = False, compiled: bool = False,
             generator: torch.Generator | None = None, row: int | None = None) -> QuantizedTensor:
    """Pack a floating-point ``tensor`` into ``bits``-bit codes (2, 4 or 8) per group of ``group_size``, aligned
    to its feature rows (:func:`row_group`; ``row``: the row length of a tensor passed flattened, else its own
    last dimension when it has 2 or 3, or its channels when it is channels-last).

    Example::

        >>> x = torch.randn(64, 256)
        >>> q = quantize(x, 4)
        >>> q.nbytes / (x.numel() * 4)        # 4.125 bits of 32
        0.12890625
        >>> (q.dequantize() - x).abs().max() <= (x.max() - x.min()) / 15
        tensor(True)
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 for quantize, got {bits!r} (use pack_mask for 1 bit)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if group_size < 8 or group_size % 8:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"quantize needs a floating-point tensor, got {tensor.dtype}")
    group_size = row_group(group_size, row if row is not None else _flattened_row(tensor))
    flat, channels_last = _memory_order_flat(tensor.detach())
    numel = flat.numel()
    full = numel // group_size
    blocks = [flat[:full * group_size].view(full, group_size)] if full else []
    if numel % group_size or numel == 0:
        # Only the tail group is copied, padded with its own last value so it does not widen the range.
        tail = flat[full * group_size:]
        pad_value = tail[-1:] if numel else torch.zeros(1, dtype=flat.dtype, device=flat.device)
        blocks.append(torch.cat([tail, pad_value.expand(group_size - tail.numel())]).view(1, group_size))
    column_noise = _column_noise(group_size, tensor.device)
    parts = [_run("encode", compiled, block, column_noise,
                  torch.rand(block.shape[0], device=tensor.device, generator=generator),
                  bits, rounding == "stochastic", sign_exact) for block in blocks]
    packed, lo_b, scale_b = parts[0] if len(parts) == 1 else (torch.cat(p) for p in zip(*parts))
    return QuantizedTensor(packed, lo_b, scale_b, bits, numel, tensor.shape, tensor.dtype, channels_last,
                           sign_exact, compiled)


def quantized_nbytes(numel: int, bits: int, group_size: int = 256, row: int | None = None) -> int:
    """Bytes :func:`quantize` (or :func:`pack_mask` for ``bits=1``) uses for ``numel`` elements in rows of ``row``."""
    if bits == 1:
        return math.ceil(numel / 8)
    group_size = row_group(group_size, row)
    n_groups = max(1, math.ceil(numel / group_size))
    return n_groups * (group_size * bits // 8 + 4)


__all__ = ["MIN_ROW_GROUP", "QuantizedTensor", "ROUNDINGS", "pack_mask", "quantize", "quantized_nbytes",
           "row_group"]
