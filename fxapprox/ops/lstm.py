"""LSTM layer with an exact forward and a structurally sparsified backward (Zhu et al.).

In an LSTM's backward, the gate gradients ``dZ_t`` (batch × 4H, gates
``i, f, g, o``) drive three GEMMs per step: ``dh_{t−1} = dZ_t·W_hh``,
``dx_t = dZ_t·W_ih`` and ``dW += dZ_tᵀ·[x_t; h_{t−1}]``. Keeping, per gate,
only ``k`` of the ``H`` columns makes every one of them a smaller dense GEMM:

* **coarse-grained** (default): the same kept hidden units for the whole
  batch at each step — the ``k`` columns of each gate with the largest norm
  over the batch; the three GEMMs run on the gathered ``4k`` columns;
* **fine-grained**: each row keeps its own ``k`` largest entries per gate
  (more faithful; the GEMMs stay full size, so it does not save time on CPU).

The forward is exact and computes the same values as ``nn.LSTM`` (to float
rounding): the input projection of all steps is one GEMM, each step adds
``h_{t−1}·W_hhᵀ`` (one oneDNN call with its ``add`` post-op) and applies the gates. ``tanh`` is
``torch.tanh`` or ``2σ(2x) − 1``, whichever a one-off timing finds faster on this CPU
(:func:`~fxapprox.ops._cpu_gemm.tanh_is_fast`).

The backward runs in blocks of time steps that share one choice of kept columns
(:class:`LSTMBackward`, ``block_steps``). Its products go through BLAS (``torch.mm``) on Intel CPUs
and through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the library ``nn.LSTM``'s own kernel
uses) elsewhere: on the AMD EPYC machines this project was first measured on, MKL ran them at about
half oneDNN's speed; on an Intel Xeon, MKL was the faster one.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from fxapprox._validate import check_choice, check_int
from fxapprox.ops._autocast import cast_like_autocast
from fxapprox.ops._cpu_gemm import (backward_products, linear, linear_add, prepacked, tanh_, tanh_is_fast)
from fxapprox.ops.sampling import rounded_count

GRANULARITIES = ("coarse", "fine")

#: time steps that share one choice of kept gate columns (see :class:`LSTMBackward`)
DEFAULT_BLOCK_STEPS = 64


@dataclass(frozen=True)
class LSTMBackward:
    """How an approximated LSTM's sparse backward runs.

    - ``granularity``: ``"coarse"`` (the same kept gate columns for the whole batch, so the backward's
      products shrink) or ``"fine"`` (each row keeps its own top-k; more faithful, not faster).
    - ``block_steps``: coarse-grained, the steps run in blocks of this many (in backward order); the
      block's first step chooses each gate's kept columns for the whole block, so the block's ``dx`` and
      weight gradients are one product each over ``block_steps · batch`` rows and the kept weight rows are
      gathered once per block. 1 chooses anew at every step; larger blocks are faster and follow the
      gradient less closely.

    Example::

        >>> LSTMBackward(block_steps=10)
        LSTMBackward(granularity='coarse', block_steps=10)
    """

    granularity: str = "coarse"
    block_steps: int = DEFAULT_BLOCK_STEPS

    def __post_init__(self) -> None:
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_int("block_steps", self.block_steps, minimum=1)


def coarse_columns(dz: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (into the ``4H`` gate columns, sorted) of each gate's ``k`` largest column norms over the batch."""
    hidden = dz.shape[1] // 4
    norms = dz.square().sum(0).view(4, hidden)
    kept = norms.topk(k, dim=1, sorted=False).indices
    kept = kept + torch.arange(0, 4 * hidden, hidden, device=dz.device).view(4, 1)
    return kept.view(-1).sort().values


def fine_mask_(dz: torch.Tensor, k: int) -> torch.Tensor:
    """Zero, in place, all but each row's ``k`` largest-magnitude entries per gate."""
    rows, width = dz.shape
    gates = dz.view(rows, 4, width // 4)
    threshold = gates.abs().topk(k, dim=2, sorted=False).values.amin(dim=2, keepdim=True)
    return gates.mul_(gates.abs() >= threshold).view(rows, width)


def _lstm_forward(x, h0, c0, w_ih, w_hh, bias, reverse):
    """One direction of one layer: ``x`` (T, B, I) → all hidden states (T, B, H), h_last, c_last, and what
    backward reads (gate activations, cell states and their tanh).

    ``reverse=True`` runs from the last step to the first (the backward direction of a
    bidirectional LSTM) without copying ``x`` or the outputs into reversed order.
    """
    steps, batch, _ = x.shape
    hidden = w_hh.shape[1]
    gates = linear(x.reshape(steps * batch, -1), w_ih, bias).view(steps, batch, 4 * hidden)
    hs = x.new_empty(steps, batch, hidden)
    cs = x.new_empty(steps, batch, hidden)
    tanh_cs = x.new_empty(steps, batch, hidden)   # kept for backward instead of recomputed there
    h, c = h0, c0
    w_hh_step = prepacked(w_hh, batch)
    fast_tanh = tanh_is_fast()
    # Every step's views made up front (one unbind each): per-step slicing was ~11 view ops, ~27 µs a step.
    z_steps, c_steps, tanh_c_steps, h_steps = gates.unbind(0), cs.unbind(0), tanh_cs.unbind(0), hs.unbind(0)
    i_steps, f_steps, g_steps, o_steps = (gates[..., j * hidden:(j + 1) * hidden].unbind(0) for j in range(4))
    if_steps = gates[..., :2 * hidden].unbind(0)
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        z = z_steps[t]
        if fast_tanh:
            pre = linear_add(h, w_hh_step, z)
            torch.sigmoid(pre[:, :2 * hidden], out=if_steps[t])
            torch.tanh(pre[:, 2 * hidden:3 * hidden], out=g_steps[t])
            torch.sigmoid(pre[:, 3 * hidden:], out=o_steps[t])
        else:
            z.add_(linear(h, w_hh_step, None))
            g_steps[t].mul_(2)
            z.sigmoid_()
            g_steps[t].mul_(2).sub_(1)     # g = tanh(pre) = 2σ(2·pre) − 1
        c = torch.mul(f_steps[t], c, out=c_steps[t]).addcmul_(i_steps[t], g_steps[t])
        tanh_c = torch.tanh(c, out=tanh_c_steps[t]) if fast_tanh else tanh_(torch.mul(c, 1, out=tanh_c_steps[t]))
        h = torch.mul(o_steps[t], tanh_c, out=h_steps[t])
    return hs, h.clone(), c.clone(), gates, cs, tanh_cs


def _shifted(states, initial, reverse):
    """The previous step's states for every step, ``(T, B, H)``: ``initial`` at the first step."""
    if reverse:
        return torch.cat([states[1:], initial.unsqueeze(0)])
    return torch.cat([initial.unsqueeze(0), states[:-1]])


def _gate_factors_out_of_place(gates, cs, c0, tanh_cs, reverse: bool):
    """:func:`_gate_factors` and the forget gate (contiguous) as one expression, for ``torch.compile`` to fuse
    into one pass: measured 1.9 against 4.0 ms eagerly for T=50, B=64, H=512 (each eager op is a pass over
    T·B·H values, and the eager version's first writes into fresh buffers fault in their pages)."""
    hidden = tanh_cs.shape[-1]
    i, f, g, o = gates.split(hidden, dim=-1)
    c_prev = torch.cat([cs[1:], c0.unsqueeze(0)]) if reverse else torch.cat([c0.unsqueeze(0), cs[:-1]])
    factors = torch.cat([(i - i * i) * g, (f - f * f) * c_prev, i - i * g * g, (o - o * o) * tanh_cs], dim=-1)
    return factors, o - o * tanh_cs * tanh_cs, f.contiguous()


_compile_failed: list[str] = []


@functools.lru_cache(maxsize=None)
def _compiled_gate_factors():
    return torch.compile(_gate_factors_out_of_place)


def _factors_and_forget(gates, cs, c0, tanh_cs, reverse):
    """``(factors, dc_from_dh, forget)`` for the backward: compiled where ``torch.compile`` works (a C++
    toolchain on CPU), else eagerly, with one warning, from then on."""
    if not _compile_failed and not torch.compiler.is_compiling():
        try:
            return _compiled_gate_factors()(gates, cs, c0, tanh_cs, reverse)
        except Exception as error:
            # Only compiler failures fall back; anything else (out of memory, bad input) is raised as is.
            if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            _compile_failed.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            warnings.warn(f"fxapprox: compiling the LSTM backward's gate factors failed ({_compile_failed[0]}); "
                          "computing them eagerly from now on (slower, same results)", RuntimeWarning, stacklevel=2)
    hidden = tanh_cs.shape[-1]
    # Contiguous: ``dc ·= f`` on the strided gate slice measured 94 against ~5 µs a step.
    return (*_gate_factors(gates, cs, c0, tanh_cs, reverse), gates[..., hidden:2 * hidden].contiguous())


def _gate_factors(gates, cs, c0, tanh_cs, reverse):
    """For every step at once, what the gate gradients ``dz`` are of ``dc`` (gates i, f, g) and ``dh`` (gate o),
    and what ``dc`` gains from ``dh``: ``dz = [dc·g·σ'(i), dc·c_{t−1}·σ'(f), dc·i·tanh'(g), dh·tanh c·σ'(o)]``,
    ``dc += dh·o·tanh'(c)``. One pass each over all ``T`` steps instead of ~20 small ops in every step; in place,
    without temporaries (a fresh T·B·H buffer costs more in page faults here than the arithmetic on it)."""
    hidden = tanh_cs.shape[-1]
    i, f, g, o = gates.split(hidden, dim=-1)
    factors = torch.empty_like(gates)
    fi, ff, fg, fo = factors.split(hidden, dim=-1)
    torch.addcmul(i, i, i, value=-1, out=fi).mul_(g)            # i − i² = σ'(i)
    torch.addcmul(f, f, f, value=-1, out=ff)
    if reverse:
        ff[:-1].mul_(cs[1:])
        ff[-1].mul_(c0)
    else:
        ff[1:].mul_(cs[:-1])
        ff[0].mul_(c0)
    torch.mul(g, i, out=fg).mul_(g)
    torch.sub(i, fg, out=fg)                                    # i − i·g² = i·tanh'(g)
    torch.addcmul(o, o, o, value=-1, out=fo).mul_(tanh_cs)
    dc_from_dh = torch.mul(o, tanh_cs).mul_(tanh_cs)
    torch.sub(o, dc_from_dh, out=dc_from_dh)                    # o − o·tanh²c
    return factors, dc_from_dh


def _lstm_backward(grad_hs, grad_h_last, grad_c_last, x, h0, c0, w_ih, w_hh, gates, hs, cs, tanh_cs, keep_ratio,
                   granularity, reverse, block_steps):
    """Gradients of :func:`_lstm_forward`'s outputs ``hs``, ``h_last``, ``c_last`` (any may be ``None``) with
    respect to ``x, h0, c0, w_ih, w_hh`` and the summed bias, keeping ``keep_ratio`` of each gate's columns.

    Coarse-grained, the steps run in blocks of ``block_steps`` (in backward order): the block's first step
    chooses the kept columns, each step's ``dh`` is one product with the block's gathered ``W_hh`` rows, and
    the block's ``dx``, ``dW_ih``, ``dW_hh`` and bias are one product each over its ``steps · batch`` rows.
    Dense (keep-ratio 1, or fine-grained), the whole sequence is one block of every column."""
    steps, batch, _ = x.shape
    hidden = w_hh.shape[1]
    k = rounded_count(keep_ratio, hidden)
    sparse = granularity == "coarse" and k < hidden
    products = backward_products(x)
    # Sums over every step: in fp32 when autocast made the layer bf16/fp16 (a T-term bf16 sum loses digits).
    accumulate = torch.float32 if w_ih.dtype in (torch.float16, torch.bfloat16) else w_ih.dtype
    dh = grad_h_last.clone() if grad_h_last is not None else x.new_zeros(batch, hidden)
    dc = grad_c_last.clone() if grad_c_last is not None else x.new_zeros(batch, hidden)
    factors, dc_from_dh, forget = _factors_and_forget(gates, cs, c0, tanh_cs, reverse)
    h_prev = _shifted(hs, h0, reverse)
    block_steps = max(1, steps if not sparse else min(block_steps, steps))
    width = 4 * k if sparse else 4 * hidden
    dz_block = x.new_empty(block_steps, batch, width)
    dz_full = x.new_empty(batch, 4 * hidden) if sparse else None
    if sparse:
        grad_x = x.new_empty(x.shape) if block_steps < steps else None
        grad_w_ih = torch.zeros(w_ih.shape, dtype=accumulate, device=w_ih.device)
        grad_w_hh = torch.zeros(w_hh.shape, dtype=accumulate, device=w_hh.device)
        grad_bias = x.new_zeros(4 * hidden, dtype=accumulate)
    else:
        w_hh_used = products.step_weight(w_hh, batch, steps)
    # Blocks in backward order: [T−L, T), [T−2L, T−L), … (reverse: [0, L), [L, 2L), …).
    starts = range(0, steps, block_steps) if reverse else range(steps - block_steps, -block_steps, -block_steps)
    # Every step's views made up front (one unbind each), as in the forward; dh and dc are fresh tensors
    # (clones, zeros or product outputs), so they are updated in place.
    grad_steps = grad_hs.unbind(0) if grad_hs is not None else None
    dc_gain_steps, forget_steps = dc_from_dh.unbind(0), forget.unbind(0)
    factor_ifg_steps = factors.view(steps, batch, 4, hidden)[:, :, :3].unbind(0)
    factor_o_steps = factors[..., 3 * hidden:].unbind(0)
    dz_rows = dz_block.unbind(0)
    gate_views = ([(dz_full.view(batch, 4, hidden)[:, :3], dz_full.view(batch, 4, hidden)[:, 3])] * block_steps
                  if sparse else [(row.view(batch, 4, hidden)[:, :3], row.view(batch, 4, hidden)[:, 3])
                                  for row in dz_rows])
    dc_column = dc.unsqueeze(1)
    for start in starts:
        lo, hi = max(start, 0), min(start + block_steps, steps)
        for t in (range(lo, hi) if reverse else range(hi - 1, lo - 1, -1)):
            if grad_steps is not None:
                dh.add_(grad_steps[t])
            dc.addcmul_(dh, dc_gain_steps[t])
            gated_ifg, gated_o = gate_views[t - lo]
            torch.mul(dc_column, factor_ifg_steps[t], out=gated_ifg)
            torch.mul(dh, factor_o_steps[t], out=gated_o)
            dc.mul_(forget_steps[t])
            dz = dz_full if sparse else dz_rows[t - lo]
            if granularity == "fine" and k < hidden:
                fine_mask_(dz, k)
            if sparse:
                if t == (lo if reverse else hi - 1):
                    kept = coarse_columns(dz, k)
                    w_hh_used = products.step_weight(torch.index_select(w_hh, 0, kept), batch, hi - lo)
                dz = torch.index_select(dz, 1, kept, out=dz_rows[t - lo])
            dh = products.step(dz, w_hh_used)
        rows = (hi - lo) * batch
        flat_dz = dz_block[:hi - lo].view(rows, width)
        x_block = x[lo:hi].reshape(rows, -1)
        h_block = h_prev[lo:hi].reshape(rows, hidden)
        if sparse:
            grad_x_block = products.input_grad(flat_dz, torch.index_select(w_ih, 0, kept))
            if hi - lo == steps:
                grad_x = grad_x_block.view(x.shape)
            else:
                grad_x[lo:hi] = grad_x_block.view(hi - lo, batch, -1)
            grad_w_ih.index_add_(0, kept, products.weight_grad(flat_dz, x_block).to(accumulate))
            grad_w_hh.index_add_(0, kept, products.weight_grad(flat_dz, h_block).to(accumulate))
            grad_bias.index_add_(0, kept, flat_dz.sum(0, dtype=accumulate))
        else:
            grad_x = products.input_grad(flat_dz, w_ih).view(x.shape)
            grad_w_ih = products.weight_grad(flat_dz, x_block)
            grad_w_hh = products.weight_grad(flat_dz, h_block)
            grad_bias = flat_dz.sum(0, dtype=accumulate)
    return grad_x, dh, dc, grad_w_ih.to(w_ih.dtype), grad_w_hh.to(w_hh.dtype), grad_bias.to(w_ih.dtype)


# The layer is two torch.library custom ops, not an autograd.Function: torch.compile keeps each one
# opaque (one node, no graph break, the time loop not unrolled into the graph: dynamo broke on its
# strided ``out=`` writes and would unroll T steps), and their FLOPs are registered formulas
# (passes/analysis/flops.py) since FlopCounterMode does not look inside a custom op.
@torch.library.custom_op("fxapprox::lstm_layer", mutates_args=())
def _lstm_layer_op(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                   bias: torch.Tensor | None, keep_ratio: float, granularity: str, reverse: bool,
                   block_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    return _lstm_forward(x, h0, c0, w_ih, w_hh, bias, reverse)


@_lstm_layer_op.register_fake
def _(x, h0, c0, w_ih, w_hh, bias, keep_ratio, granularity, reverse, block_steps):
    steps, batch, _ = x.shape
    hidden = w_hh.shape[1]
    states = x.new_empty(steps, batch, hidden)
    return (states, h0.new_empty(batch, hidden), c0.new_empty(batch, hidden), x.new_empty(steps, batch, 4 * hidden),
            torch.empty_like(states), torch.empty_like(states))


@torch.library.custom_op("fxapprox::lstm_layer_backward", mutates_args=())
def _lstm_layer_backward_op(grad_hs: torch.Tensor | None, grad_h_last: torch.Tensor | None,
                            grad_c_last: torch.Tensor | None, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                            w_ih: torch.Tensor, w_hh: torch.Tensor, gates: torch.Tensor, hs: torch.Tensor,
                            cs: torch.Tensor, tanh_cs: torch.Tensor, keep_ratio: float, granularity: str,
                            reverse: bool, block_steps: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    return _lstm_backward(grad_hs, grad_h_last, grad_c_last, x, h0, c0, w_ih, w_hh, gates, hs, cs, tanh_cs,
                          keep_ratio, granularity, reverse, block_steps)


@_lstm_layer_backward_op.register_fake
def _(grad_hs, grad_h_last, grad_c_last, x, h0, c0, w_ih, w_hh, gates, hs, cs, tanh_cs, keep_ratio, granularity,
      reverse, block_steps):
    return (torch.empty_like(x), torch.empty_like(h0), torch.empty_like(c0), torch.empty_like(w_ih),
            torch.empty_like(w_hh), w_ih.new_empty(w_ih.shape[0]))


def _lstm_setup_context(ctx, inputs, output):
    x, h0, c0, w_ih, w_hh, bias, keep_ratio, granularity, reverse, block_steps = inputs
    hs, _, _, gates, cs, tanh_cs = output
    ctx.save_for_backward(x, h0, c0, w_ih, w_hh, gates, hs, cs, tanh_cs)
    ctx.options = (keep_ratio, granularity, reverse, block_steps, bias is not None)
    # Outputs backward never gets a gradient for (gates, cell states) stay None instead of T·B·4H zeros.
    ctx.set_materialize_grads(False)


def _lstm_layer_autograd(ctx, grad_hs, grad_h_last, grad_c_last, *_unused_grads):
    keep_ratio, granularity, reverse, block_steps, has_bias = ctx.options
    grad_x, dh0, dc0, grad_w_ih, grad_w_hh, grad_bias = _lstm_layer_backward_op(
        grad_hs, grad_h_last, grad_c_last, *ctx.saved_tensors, keep_ratio, granularity, reverse, block_steps)
    return grad_x, dh0, dc0, grad_w_ih, grad_w_hh, (grad_bias if has_bias else None), None, None, None, None


_lstm_layer_op.register_autograd(_lstm_layer_autograd, setup_context=_lstm_setup_context)


def sparse_backward_lstm_layer(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_ih: torch.Tensor,
                               w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None,
                               keep_ratio: float = 1.0, granularity: str = "coarse", reverse: bool = False,
                               block_steps: int = 1):
    """One LSTM layer, one direction, time-major ``x`` (T, B, I); returns ``(hs, h_last, c_last)``.

    The forward is exact; the backward keeps ``keep_ratio`` of each gate's gradient columns.

    Example::

        >>> lstm = torch.nn.LSTM(8, 16)
        >>> x, h0 = torch.randn(5, 3, 8), torch.zeros(3, 16)
        >>> hs, h, c = sparse_backward_lstm_layer(x, h0, h0, lstm.weight_ih_l0, lstm.weight_hh_l0,
        ...                                       lstm.bias_ih_l0, lstm.bias_hh_l0, keep_ratio=0.5)
        >>> torch.allclose(hs, lstm(x)[0], atol=1e-6)
        True
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    # Under autocast the layer runs in its dtype, as nn.LSTM does (a lower-precision op there).
    x, h0, c0, w_ih, w_hh, b_ih, b_hh = cast_like_autocast(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    bias = None if b_ih is None else b_ih + b_hh   # autograd hands the summed bias's gradient to both
    hs, h_last, c_last, *_ = _lstm_layer_op(x.contiguous(), h0.contiguous(), c0.contiguous(), w_ih, w_hh, bias,
                                            float(keep_ratio), granularity, bool(reverse), int(block_steps))
    return hs, h_last, c_last
