"""Sampled linear layers: ``x · Wᵀ`` as a sum of ``n = in_features`` column-row pairs.

**Forward sampling** (:func:`sampled_linear`): ``y ≈ x[:, S] · W[:, S]ᵀ + b``.
The forward GEMM and both backward GEMMs shrink by ``|S| / n``. The autograd
Function saves only the gathered ``x[:, S]`` and ``W[:, S]`` and writes
gradients only into the kept columns; letting autograd differentiate
``index_select`` instead costs a full-size scatter per operand (measured slower
than the dense layer on CPU).

**Backward sampling** (:func:`backward_sampled_linear`): the forward is exact;
``dX = dY · W`` keeps the strongest output features ``j`` (``‖dY[:, j]‖·‖W[j]‖``)
and ``dW = dYᵀ · X`` the strongest batch rows ``b`` (``‖X_b‖·‖dY_b‖``).
**Weight-gradient sampling** (``sample_input_grad=False``) keeps ``dX`` exact and
samples only ``dW`` over rows — tokens, for a transformer's ``(B, T, C)`` inputs —
the setting of WTA-CRS (Liu et al., 2023): the error stays in this layer's own
gradient instead of flowing into every layer below.
"""

from __future__ import annotations

import threading
import weakref

import torch

from fxapprox._validate import check_choice
from fxapprox.ops._autocast import cast_like_autocast
from fxapprox.ops.sampling import rounded_count, select_pairs
from fxapprox.ops.training_context import note_derived


def _nonempty(kept: torch.Tensor, scale: torch.Tensor | None, scores: torch.Tensor):
    """Bernoulli sampling may keep nothing: keep one pair at scale 0 (an exact zero estimate)."""
    if kept.numel():
        return kept, scale
    return scores.argmax().view(1), torch.zeros(1, device=scores.device)


def gather_columns(matrix: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``matrix[:, kept]`` of a 2-D tensor. ``torch.gather`` with the indices broadcast over the rows, not
    ``index_select(1, …)``: on CPU the latter walks a row-major matrix column by column, ~4× slower (a 2048×2048
    weight, half its columns: 0.65 against 2.4 ms)."""
    return torch.gather(matrix, 1, kept.expand(matrix.shape[0], -1))


def scatter_columns(values: torch.Tensor, kept: torch.Tensor, columns: int) -> torch.Tensor:
    """A zero ``(rows, columns)`` matrix with ``values`` in its ``kept`` columns (a sampled layer's gradient).
    ``scatter_`` rather than ``index_copy_(1, …)``, for the reason of :func:`gather_columns` (1.3 against 2.6 ms
    for a 2048×2048 weight gradient)."""
    out = values.new_zeros(values.shape[0], columns)
    return out.scatter_(1, kept.expand(values.shape[0], -1), values)


def _scaled(tensor: torch.Tensor, scale: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``tensor`` scaled along ``dim``, **in place**: every caller passes a tensor it has just made (a gather, a
    product), and a second full-size result would be one more allocation whose pages fault in every step."""
    if scale is None:
        return tensor
    shape = [1] * tensor.dim()
    shape[dim] = -1
    return tensor.mul_(scale.to(tensor.dtype).view(shape))


#: what a forward-sampled layer keeps of its input for backward: the input itself (a reference: free when
#: another node saves it anyway) or a gathered copy of the kept columns (smaller, when nothing else saves it)
INPUT_SAVING = ("reference", "gathered")


def save_sampled_operands(ctx, x, x_kept, weight, kept, scale, keep_input: bool) -> None:
    """Save what a forward-sampled op's backward needs: ``x`` itself (``keep_input``) or its gathered (and scaled)
    ``x_kept``, the weight itself, the kept indices and the scale."""
    if keep_input:
        ctx.save_for_backward(x, weight, kept, scale)
    else:
        note_derived(x_kept, x)
        ctx.save_for_backward(x_kept, weight, kept, scale)
    ctx.keep_input = keep_input


def kept_input(ctx, x_saved: torch.Tensor, kept: torch.Tensor, scale) -> torch.Tensor:
    """The gathered, scaled input from what :func:`save_sampled_operands` saved."""
    if not ctx.keep_input:
        return x_saved
    gathered = gather_columns(x_saved, kept) if x_saved.dim() == 2 else x_saved.index_select(1, kept)
    return _scaled(gathered, scale, 1)


class _SampledLinearFunction(torch.autograd.Function):
    """``x2d[:, kept] @ weight[:, kept]ᵀ (· scale) + bias`` with sparse-column gradients.

    Saves ``weight`` itself (a parameter, or a value the exact op would save whole as well), never a gathered
    copy: the copy would be ``k/n`` of the weight on top of what the exact layer saves. ``x2d`` is saved as is
    with ``keep_input``, else its gathered columns. Backward gathers what it needs again."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, kept, scale, keep_input):
        x_kept = _scaled(gather_columns(x2d, kept), scale, 1)
        w_kept = gather_columns(weight, kept)
        out = x_kept @ w_kept.t() if bias is None else torch.addmm(bias, x_kept, w_kept.t())
        save_sampled_operands(ctx, x2d, x_kept, weight, kept, scale, keep_input)
        ctx.in_features = x2d.shape[1]
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_saved, weight, kept, scale = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = scatter_columns(_scaled(grad_out @ gather_columns(weight, kept), scale, 1), kept,
                                     ctx.in_features)
        if ctx.needs_input_grad[1]:
            # x_kept carries the scale, so dW[:, S] = dYᵀ · x_kept.
            grad_w = scatter_columns(grad_out.t() @ kept_input(ctx, x_saved, kept, scale), kept, ctx.in_features)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


#: rows squared and accumulated at a time by :func:`squared_norms` over the first dimension of a 2-D tensor (256:
#: fastest on these CPUs whether the tensor is in cache or not, 1 MiB for 1024 fp32 columns)
_NORM_ROWS = 256
#: elements squared at a time by :func:`squared_norms` for other reductions (a 1 MiB fp32 temporary stays in cache)
_NORM_CHUNK = 1 << 18


def squared_norms(tensor: torch.Tensor, dim) -> torch.Tensor:
    """``Σ t²`` over ``dim`` in fp32.

    Not ``torch.linalg.vector_norm`` over a leading dimension: on CPU it reduces 4–5× slower (measured on a
    2048×2048 weight); the scores only need norms up to a monotone map. The column norms of a wide 2-D tensor (a
    weight's ``‖W[:, i]‖²``, an input's ``‖x[:, i]‖²``) are accumulated ``_NORM_ROWS`` rows at a time into one small
    buffer with ``addcmul_`` and summed once (0.3 ms for a 2048×2048 weight, against 1.3 ms for ``square().sum(0)``,
    which writes a full-size temporary whose pages fault in anew every step); narrow ones (under 512 columns: a
    transformer's features) reduce fastest in that one pass. Norms over every dimension but the first (a 2-D
    tensor's rows, a convolution input's examples, a weight's output channels) are ``vector_norm`` along the
    contiguous memory (2.5× faster than ``square().sum``). Other reductions are squared in slices along the first
    dimension.
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    dims = tuple(d % tensor.dim() for d in dims) if tensor.dim() else dims
    if tensor.dim() == 2 and dims == (0,):
        wide = tensor.shape[0] >= 2 * _NORM_ROWS and tensor.shape[1] >= 512
        return _column_norms(tensor) if wide else _squared_sum(tensor, dims)
    if tensor.dim() >= 2 and dims == tuple(range(1, tensor.dim())) and tensor.is_contiguous():
        # every dimension but the first (a 2-D tensor's rows, a conv input's examples, a weight's output channels)
        return torch.linalg.vector_norm(tensor.reshape(tensor.shape[0], -1), dim=1, dtype=torch.float32).square_()
    if tensor.dim() == 0 or tensor.numel() <= _NORM_CHUNK or tensor.shape[0] < 2:
        return _squared_sum(tensor, dims)
    rows = max(1, _NORM_CHUNK // max(1, tensor[0].numel()))
    parts = [_squared_sum(piece, dims) for piece in tensor.split(rows, 0)]
    if 0 in dims:
        total = parts[0]
        for part in parts[1:]:
            total.add_(part)
        return total
    return torch.cat(parts, 0)


def _squared_sum(tensor: torch.Tensor, dims: tuple) -> torch.Tensor:
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()  # fp16 squares overflow past 256
    return tensor.square().sum(dims, dtype=torch.float32)


def _column_norms(tensor: torch.Tensor) -> torch.Tensor:
    """``Σ_i t[i, :]²`` of a tall 2-D tensor: ``_NORM_ROWS`` rows at a time into one buffer (see
    :func:`squared_norms`)."""
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return _squared_sum(tensor.float(), (0,))   # fp16 squares overflow past 256
    full = tensor.shape[0] // _NORM_ROWS * _NORM_ROWS
    buffer = tensor[:_NORM_ROWS].square()
    for block in tensor[_NORM_ROWS:full].split(_NORM_ROWS, 0):
        buffer.addcmul_(block, block)
    total = buffer.sum(0, dtype=torch.float32)
    if full < tensor.shape[0]:
        total += _squared_sum(tensor[full:], (0,))
    return total


def pair_scores(a_squared: torch.Tensor, b_squared: torch.Tensor) -> torch.Tensor:
    """``‖A_i‖·‖B_i‖`` from the two squared norms."""
    return (a_squared * b_squared).sqrt_()


class _SharedInputNorms:
    """The squared norms of the inputs last scored, so that layers reading one input (a transformer's q, k and v
    projections, its gate and up projections) compute them once: torch.fx keeps those layers apart, so they do
    not become one fused sampled block, but they run one after the other on the same tensor, in forward (its
    column norms) and in backward (its row norms).

    An entry is reused only while the tensor it was computed from is alive (a weak reference to its storage's
    owner) and unchanged (its data pointer, shape, strides and version counter); under ``torch.compile`` nothing
    is kept (the compiled graph computes the norms itself)."""

    def __init__(self) -> None:
        self.entries: dict = {}

    def __call__(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return squared_norms(tensor, dim)
        owner = tensor._base if tensor._base is not None else tensor
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, dim)
        entry = self.entries.get(dim)
        if entry is not None and entry[0] == key and entry[1]() is owner and entry[2] == owner._version:
            return entry[3]
        norms = squared_norms(tensor, dim)
        self.entries[dim] = (key, weakref.ref(owner), owner._version, norms)
        return norms


#: the shared-input memo of the sampled linear ops (one per thread: autograd may run backward on another thread)
_input_norms = threading.local()


def input_squared_norms(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`squared_norms` of a layer's input over ``dim``, shared with the layers that read the same input
    (:class:`_SharedInputNorms`)."""
    if torch.compiler.is_compiling():
        # the memo is eager-only, and created on first use: a traced backward must not create it (a side effect
        # dynamo refuses inside autograd.Function's backward); a compiled graph shares the computation itself
        return squared_norms(tensor, dim)
    memo = getattr(_input_norms, "memo", None)
    if memo is None:
        memo = _input_norms.memo = _SharedInputNorms()
    return memo(tensor, dim)


def pair_scores_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``‖x[:, i]‖ · ‖W[:, i]‖`` for every input feature ``i`` (fp32, no autograd)."""
    with torch.no_grad():
        return pair_scores(input_squared_norms(x2d, 0), squared_norms(weight, 0))


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    in_features = weight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {in_features}")
    return in_features


def sampled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                   method: str = "topk", random_share: float = 0.0, save_input: str = "reference") -> torch.Tensor:
    """Approximate ``F.linear(x, weight, bias)`` keeping ``k`` of ``in_features`` pairs (forward sampling).

    With ``k >= in_features`` this is exactly ``F.linear``. ``save_input``: ``"reference"`` (default) keeps
    ``x`` itself for backward — no more memory than the exact layer, none at all where something else saves
    ``x`` anyway; ``"gathered"`` keeps a copy of its kept columns — ``k/n`` of it, less memory where this layer
    is ``x``'s only saver (the plan chooses per layer, see ``fxapprox.passes.policy.input_saving``).

    Example::

        >>> x, w = torch.randn(8, 64), torch.randn(32, 64)
        >>> sampled_linear(x, w, None, k=64).allclose(x @ w.t())
        True
    """
    in_features = _check(x, weight)
    if k >= in_features:
        return torch.nn.functional.linear(x, weight, bias)
    if k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    x, weight, bias = cast_like_autocast(x, weight, bias)
    scores = pair_scores_linear(x.reshape(-1, in_features), weight)
    kept, scale = _nonempty(*select_pairs(method, scores, k, random_share), scores)
    return linear_with_pairs(x, weight, bias, kept, scale, save_input)


def linear_with_pairs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kept: torch.Tensor,
                      scale: torch.Tensor | None, save_input: str = "reference") -> torch.Tensor:
    """Forward-sampled ``F.linear`` on pairs chosen by the caller (``kept`` sorted, ``scale`` or ``None``).

    Used where the choice must not depend on the local batch (the DDP hook picks from weights only).
    ``save_input`` as in :func:`sampled_linear`.
    """
    in_features = _check(x, weight)
    check_choice("save_input", save_input, INPUT_SAVING)
    x, weight, bias = cast_like_autocast(x, weight, bias)
    x2d = x.reshape(-1, in_features)
    # Flattening a non-contiguous (batched, transposed) operand may copy it: a new tensor nothing else saves,
    # whose kept columns are the smaller thing to keep. (A 2-D operand is always viewed, never copied.)
    keep_input = save_input == "reference" and (x.dim() <= 2 or x.is_contiguous())
    out = _SampledLinearFunction.apply(x2d, weight, bias, kept, scale, keep_input)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _BackwardSampledLinearFunction(torch.autograd.Function):
    """Exact ``x2d @ weightᵀ + bias``; the weight-gradient GEMM (and, with ``sample_input_grad``, the
    input-gradient GEMM) sampled at ``keep_ratio``."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, keep_ratio, method, random_share, sample_input_grad):
        out = x2d @ weight.t() if bias is None else torch.addmm(bias, x2d, weight.t())
        ctx.save_for_backward(x2d, weight)
        ctx.options = (keep_ratio, method, random_share, sample_input_grad)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        keep_ratio, method, random_share, sample_input_grad = ctx.options
        grad_x = grad_w = grad_b = None
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                if sample_input_grad:
                    scores = pair_scores(squared_norms(grad_out, 0), squared_norms(weight, 1))
                    kept, scale = _nonempty(*select_pairs(method, scores, rounded_count(keep_ratio, weight.shape[0]),
                                                          random_share), scores)
                    grad_x = _scaled(gather_columns(grad_out, kept), scale, 1) @ weight.index_select(0, kept)
                else:
                    grad_x = grad_out @ weight
            if ctx.needs_input_grad[1]:
                grad_w = sampled_rows_product(grad_out, x2d, keep_ratio, method, random_share)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = grad_out.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


def sampled_rows_product(grad_out: torch.Tensor, x2d: torch.Tensor, keep_ratio: float, method: str,
                         random_share: float = 0.0) -> torch.Tensor:
    """``grad_outᵀ · x2d`` (a weight gradient) summed over ``keep_ratio`` of the rows, chosen by
    ``‖x_b‖·‖dy_b‖`` with ``method`` (and scaled when it is unbiased)."""
    rows = grad_out.shape[0]
    if rows == 0:
        return grad_out.new_zeros(grad_out.shape[1], x2d.shape[1])
    scores = pair_scores(input_squared_norms(x2d, 1), squared_norms(grad_out, 1))
    kept, scale = _nonempty(*select_pairs(method, scores, rounded_count(keep_ratio, rows), random_share), scores)
    return _scaled(grad_out.index_select(0, kept), scale, 0).t() @ x2d.index_select(0, kept)


def backward_sampled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            keep_ratio: float, method: str = "topk", random_share: float = 0.0,
                            sample_input_grad: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` exactly, with the backward GEMMs sampled (backward sampling).

    ``dW`` keeps ``round(keep_ratio · rows)`` batch rows (tokens, for ``(B, T, C)`` inputs);
    ``dX`` keeps ``round(keep_ratio · out_features)`` output features, or is exact with
    ``sample_input_grad=False`` (weight-gradient sampling: only the layer's own gradient is
    approximated, nothing propagates to the layers below). ``keep_ratio >= 1`` is exact.

    Example::

        >>> y = backward_sampled_linear(x, w, b, keep_ratio=0.5)   # y == F.linear(x, w, b)
    """
    in_features = _check(x, weight)
    if keep_ratio >= 1.0:
        return torch.nn.functional.linear(x, weight, bias)
    if not keep_ratio > 0.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    lead_shape = x.shape[:-1]
    x, weight, bias = cast_like_autocast(x, weight, bias)
    out = _BackwardSampledLinearFunction.apply(x.reshape(-1, in_features), weight, bias, keep_ratio, method,
                                               random_share, sample_input_grad)
    return out.reshape(*lead_shape, weight.shape[0])
