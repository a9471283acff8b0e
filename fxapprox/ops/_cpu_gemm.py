"""The LSTM's CPU products, tuned per CPU: oneDNN (``torch.ops.mkldnn._linear_pointwise``, the library
``nn.LSTM``'s own kernel uses) or BLAS (``torch.mm``), weights prepacked where a block of steps reuses them, and
``tanh`` as ``torch.tanh`` or ``2σ(2x) − 1``, whichever a one-off timing finds faster. On the AMD EPYC machines
this project was first measured on, MKL ran the backward's products at about half oneDNN's speed; on an Intel
Xeon, MKL was the faster one (``benchmarks/lstm_limits.py``).
"""

from __future__ import annotations

import functools
import time

import torch

__all__ = ["backward_products", "linear", "linear_add", "matmul", "prepacked", "tanh_", "tanh_is_fast",
           "weight_grad"]

_ONEDNN_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x · weightᵀ + bias`` through oneDNN on CPU when torch has it (as ``nn.LSTM``'s own kernel does:
    measured 1.3–1.4× faster than ``addmm`` for the LSTM's shapes here), else ``F.linear``."""
    if (_ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_grad_enabled()):
        try:
            return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        except RuntimeError:
            pass  # a build without oneDNN: the same product through addmm
    return torch.nn.functional.linear(x, weight, bias)


_ONEDNN_REORDER = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)


def prepacked(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` reordered once into oneDNN's blocked layout for :func:`linear` products of ``rows`` rows,
    where the same weight serves many time steps: measured 670 → 606 µs for the forward's (64 × 512)·(512 ×
    2048) step product and 380 → 311 µs for the backward's, for a one-off 0.3–0.8 ms reorder. ``weight``
    unchanged where oneDNN is not used (another device or dtype, grad mode on, or a build without it)."""
    if (_ONEDNN_LINEAR is not None and _ONEDNN_REORDER is not None and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and not torch.is_grad_enabled()):
        try:
            return _ONEDNN_REORDER(weight.contiguous(), rows)
        except RuntimeError:
            pass  # a build without oneDNN: the plain weight
    return weight


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` through the same oneDNN path as :func:`linear`: on this project's AMD CPUs ``torch.mm``
    (MKL) ran the backward's products at 70–90 GFLOP/s on one thread, oneDNN at 150–175."""
    return linear(a, b.t(), None)


def weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``grad_outᵀ · inputs``, computed as ``(inputsᵀ · grad_out)ᵀ``: with oneDNN on two threads that
    operand order measured 1.3× faster for the LSTM's (4H × T·B)·(T·B × I) product (the same on one thread)."""
    return matmul(inputs.t(), grad_out).t().contiguous()


def tanh_(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2).sigmoid_().mul_(2).sub_(1)


@functools.lru_cache(maxsize=None)
def tanh_is_fast() -> bool:
    """Whether ``torch.tanh`` is at least as fast as ``2σ(2x) − 1`` on this CPU, timed once on a step-sized
    tensor. On the AMD EPYC machines this project was first measured on, ``torch.tanh`` was ~5× slower than
    ``torch.sigmoid``; on an Intel Xeon it is 5× faster than the four-op sigmoid form (7.8 against 39 µs for
    64 × 512). The two differ by float rounding only."""
    sample, out = torch.linspace(-4, 4, 64 * 512).view(64, 512), torch.empty(64, 512)   # no draw from the RNG

    def best(fn) -> float:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        best(lambda: torch.tanh(sample, out=out))   # warm-up
        return best(lambda: torch.tanh(sample, out=out)) <= best(lambda: tanh_(torch.mul(sample, 1, out=out)))


def linear_add(x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ + other`` in one oneDNN call (its ``add`` post-op) where :func:`linear` uses oneDNN."""
    if (_ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.is_grad_enabled()):
        try:
            return _ONEDNN_LINEAR.binary(x, other, weight, None, "add")
        except RuntimeError:
            pass  # a build without oneDNN
    return torch.addmm(other, x, weight.t())


_CONTIGUOUS_WEIGHT_ROWS = 1024
#: a block's step product uses a prepacked weight from this many steps on (the reorder costs ~11 steps' gain)
_PREPACK_STEPS = 16


@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    """The CPU's vendor (read once, on first use: no work at import time)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


class _OneDNNProducts:
    """The backward's products through oneDNN (:func:`linear`), with its weights prepacked where a block's
    steps reuse them. MKL runs these products at about half oneDNN's speed on AMD CPUs (76–86 against 159–174
    GFLOP/s on one thread, ``benchmarks/lstm_limits.py``): MKL picks its fast kernels on Intel CPUs only."""

    @staticmethod
    def step_weight(w_hh_rows: torch.Tensor, batch: int, steps: int) -> torch.Tensor:
        weight = w_hh_rows.t()
        return prepacked(weight, batch) if steps >= _PREPACK_STEPS else weight

    @staticmethod
    def step(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(dz, weight, None)

    @staticmethod
    def input_grad(flat_dz: torch.Tensor, w_ih_rows: torch.Tensor) -> torch.Tensor:
        if flat_dz.shape[0] >= _CONTIGUOUS_WEIGHT_ROWS:
            # (I × 4k) contiguous: measured 1.35× faster than the transposed view for 3200 rows; the
            # transpose (~0.5 ms) pays back only on large blocks
            return linear(flat_dz, w_ih_rows.t().contiguous(), None)
        return matmul(flat_dz, w_ih_rows)

    weight_grad = staticmethod(weight_grad)


class _BlasProducts:
    """The backward's products through ``torch.mm`` (MKL on x86): on an Intel Xeon here, 138 against oneDNN's
    172 µs for a (64 × 512)·(512 × 512) step product, and 5.4 against 7.2 ms for a weight gradient over 3200
    rows (the BLAS call takes the transposed operand as it is; oneDNN needs it copied)."""

    @staticmethod
    def step_weight(w_hh_rows: torch.Tensor, batch: int, steps: int) -> torch.Tensor:
        return w_hh_rows

    @staticmethod
    def step(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.mm(dz, weight)

    @staticmethod
    def input_grad(flat_dz: torch.Tensor, w_ih_rows: torch.Tensor) -> torch.Tensor:
        return torch.mm(flat_dz, w_ih_rows)

    @staticmethod
    def weight_grad(grad_out: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.mm(grad_out.t(), inputs)


def backward_products(tensor: torch.Tensor):
    """Which library runs the backward's products for ``tensor``'s device and dtype."""
    if (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and _ONEDNN_LINEAR is not None
            and _cpu_vendor() != "GenuineIntel"):
        return _OneDNNProducts
    return _BlasProducts
