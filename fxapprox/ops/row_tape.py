"""The tape of a row-sampled block (``fxapprox.ops.rows``): its linear layers' outputs recorded by its forward and
handed back, for the kept rows, by its replay — so the replay repeats none of the forward's GEMMs — and the linear
layer as such a block computes it (:func:`row_linear`), its weight gradient optionally over a share of the kept rows'
tokens (VCAS's SampleW: PPS on the leverage scores ``‖dY_t‖·‖X_t‖``, scaled: unbiased).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from fxapprox.ops._autocast import cast_like_autocast
from fxapprox.ops.linear import backward_sampled_linear, pair_scores, sampled_rows_product, squared_norms
from fxapprox.ops.sampling import inclusion_probabilities, rounded_count

__all__ = ["RowTape", "TOKEN_METHOD", "gather_rows", "recording", "row_linear", "token_sampling"]

#: how a kept row's tokens are sampled for a weight gradient (``token_ratio < 1``): PPS on leverage scores
TOKEN_METHOD = "pps"


class RowTape:
    """The outputs of a block's linear layers, recorded in call order by its forward, handed back by its replay
    for the kept rows (see the module docstring)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.outputs: list[torch.Tensor] = []
        self.rows: torch.Tensor | None = None     # the replay's kept rows (None: every row)
        self.position = 0
        self.recording = True
        self.token_ratio = 1.0
        self.record: dict | None = None
        self.versions: list[int] = []

    def add(self, out: torch.Tensor) -> None:
        """Record a linear layer's output (and its version: a change in place after this is an error)."""
        self.outputs.append(out)
        self.versions.append(out._version)

    def replay(self, rows: torch.Tensor | None, token_ratio: float, record: dict | None) -> None:
        self.rows, self.position, self.recording = rows, 0, False
        self.token_ratio, self.record = token_ratio, record

    def next_output(self, lead_shape: torch.Size) -> torch.Tensor:
        """The next recorded output, gathered at the kept rows; its leading shape must be ``lead_shape`` (the
        replayed layer's input's): a block whose replay does not retrace its forward is an error, never a silently
        wrong gradient."""
        if self.position >= len(self.outputs):
            raise RuntimeError("fxapprox: a row-sampled block called more linear layers in its replay on the kept "
                               "rows than in its forward; its code must not depend on the batch size")
        out = self.outputs[self.position]
        if out._version != self.versions[self.position]:
            raise RuntimeError("fxapprox: a row-sampled block changed a linear layer's output in place after its "
                               "forward; its replay cannot hand that output back")
        self.position += 1
        # a gathered copy, or the recorded output itself detached (a new tensor: a replay's autograd history never
        # sticks to what the tape keeps for the next one)
        out = gather_rows(out, self.rows, self.batch) if self.rows is not None else out.detach()
        if out.shape[:-1] != lead_shape:
            raise RuntimeError(f"fxapprox: a row-sampled block's linear layer got input rows {tuple(lead_shape)} in "
                               f"its replay but produced {tuple(out.shape[:-1])} for them in its forward; the block's "
                               "samples are not the first dimension of what its layers see")
        return out


def gather_rows(tensor: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """The kept samples' part of ``tensor``: rows of its first dimension when that is the batch, or the kept
    samples' blocks of it when a layer sees the batch flattened with its tokens (``batch · m`` rows, sample-major)."""
    if tensor.shape[0] == batch:
        return tensor.index_select(0, rows)
    per_sample = tensor.shape[0] // batch
    if per_sample * batch != tensor.shape[0]:
        raise RuntimeError(f"fxapprox: a row-sampled block's value has {tensor.shape[0]} rows, not a multiple of its "
                           f"batch of {batch} samples")
    index = (rows.unsqueeze(1) * per_sample + torch.arange(per_sample, device=rows.device)).reshape(-1)
    return tensor.index_select(0, index)


_TAPE: contextvars.ContextVar[RowTape | None] = contextvars.ContextVar("fxapprox_row_tape", default=None)


@contextlib.contextmanager
def recording(tape: RowTape | None):
    """Run a block's forward (recording) or replay with ``tape`` in force for its linear layers."""
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


class _ReplayLinear(torch.autograd.Function):
    """A linear layer in a block's replay: its forward hands back the output recorded for the kept rows (no
    GEMM); its backward computes ``dX = dY·W`` and ``dW = dYᵀ·X`` from the replayed input ``X`` of those rows, the
    weight gradient over ``token_ratio`` of their tokens (PPS on ``‖dY_t‖·‖X_t‖``, scaled: unbiased)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tape):
        out = tape.next_output(x.shape[:-1])
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.token_ratio, ctx.record = tape.token_ratio, tape.record
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        grad2d = grad_out.reshape(-1, grad_out.shape[-1])
        x2d = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = (grad2d @ weight.to(grad2d.dtype)).view(x.shape)
        if ctx.needs_input_grad[1]:
            ratio = ctx.token_ratio
            if ratio < 1.0 and grad2d.shape[0] > 1:
                if ctx.record is not None:
                    _record_token_variance(ctx.record, grad2d, x2d, ratio)
                grad_w = sampled_rows_product(grad2d, x2d.to(grad2d.dtype), ratio, TOKEN_METHOD)
            else:
                grad_w = grad2d.t() @ x2d.to(grad2d.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)
        return grad_x, grad_w, grad_b, None


def _record_token_variance(record: dict, grad2d: torch.Tensor, x2d: torch.Tensor, ratio: float) -> None:
    """Add the token sampling's variance ``Σ_t (1/π_t − 1)·‖dY_t‖²‖X_t‖²`` (Horvitz–Thompson) to ``record``."""
    with torch.no_grad():
        products = squared_norms(grad2d, 1) * squared_norms(x2d, 1)
        probabilities = inclusion_probabilities(pair_scores(squared_norms(x2d, 1), squared_norms(grad2d, 1)),
                                                rounded_count(ratio, grad2d.shape[0]))
        spread = torch.where(probabilities > 0, (1.0 / probabilities.clamp_min(1e-12) - 1.0) * products, 0.0)
        record["token_variance"] = record.get("token_variance", 0.0) + float(spread.sum())


_TOKENS: contextvars.ContextVar[float | None] = contextvars.ContextVar("fxapprox_row_tokens", default=None)


@contextlib.contextmanager
def token_sampling(ratio: float):
    """Run a block that keeps every row with its linear layers' weight gradients over ``ratio`` of the tokens."""
    token = _TOKENS.set(ratio)
    try:
        yield
    finally:
        _TOKENS.reset(token)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a linear layer of a row-sampled block computes it: exactly, recorded in
    the block's forward, handed back (:class:`_ReplayLinear`) in its replay; in a block that keeps every row this
    step, exactly with its weight gradient over the token share in force (``backward_sampled_linear``, PPS);
    outside a row-sampled block's run (evaluation) plain ``F.linear``."""
    tape = _TAPE.get()
    if tape is None:
        tokens = _TOKENS.get()
        if tokens is not None and torch.is_grad_enabled():
            return backward_sampled_linear(x, weight, bias, tokens, TOKEN_METHOD, sample_input_grad=False)
        return F.linear(x, weight, bias)
    if tape.recording:
        out = F.linear(x, weight, bias)
        tape.add(out)
        return out
    x, weight, bias = cast_like_autocast(x, weight, bias)
    return _ReplayLinear.apply(x, weight, bias, tape)
