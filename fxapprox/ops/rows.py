"""Row sampling of the backward: a block's backward runs on the samples it keeps, and only on them.

The forward of a block (a transformer layer, a residual block — anything that treats the samples of a batch
independently) is exact and whole. Its backward starts from the gradient of its outputs, one row per sample:
sample ``i`` is kept with probability ``π_i ∝ ‖dY_i‖`` (PPS water-filling, VCAS's "soft top-k": the strongest kept
surely, ``Σ π = k``; :func:`fxapprox.ops.sampling.select_pps`) and its gradient scaled by ``1 / π_i``
(Horvitz–Thompson: unbiased). Every op of the block then runs its backward on the ``k`` kept rows — gathered, not
zero-filled — attention and normalisation included, and the layers' weight gradients may be sampled again over the
kept rows' tokens (``token_ratio``, leverage scores ``‖dY_t‖·‖X_t‖``). A row dropped at one block carries no gradient
into the blocks below it, which keep a subset of what is left (their ratios are never higher).

How: the block's forward runs without autograd while its linear layers record their outputs (a tape:
``fxapprox.ops.row_tape``); in backward, once the rows are chosen, the block runs again on the kept rows with
autograd, each linear layer handing back its recorded output for those rows instead of computing it (no GEMM) and
computing its input and weight gradients from the replayed input in its backward. So the forward's GEMMs are not
repeated; the block's cheap ops (norms, activations, attention) are, on the kept rows only. A block that mixes
samples (BatchNorm in training), draws random numbers (dropout) or whose rows are not its inputs' first dimension
cannot be sampled this way; planning probes each block for that (``fxapprox.passes.measurement.measure_rows``).

Per-token dropping would not shrink attention's backward: every kept query still reads every key and value of its
sequence, so the sequences' attention backward stays whole; dropping whole samples removes their attention too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxapprox.ops.linear import squared_norms
from fxapprox.ops.row_tape import RowTape, gather_rows, recording, token_sampling
from fxapprox.ops.sampling import select_pairs

__all__ = ["RowSampledBlock", "RowSampler", "batch_of", "is_cache", "kept_rows_count", "row_norms", "row_sampled_call",
           "sampling"]

#: how rows are chosen: PPS on their gradient norms (the minimum-variance fixed-size choice)
ROW_METHOD = "pps"


@dataclass
class RowSampler:
    """What the row-sampled blocks of one model do on the next backward: shared by every block, mutable.

    ``ratios``: the keep-ratio (a share of the batch's samples) of each block by name; a block not named keeps
    every row. ``token_ratio``: the share of the kept rows' tokens each linear layer's weight gradient keeps
    (1: exact). ``given_rows``: keep exactly these rows, unscaled, in every block (the variance measurement's
    group passes: the exact gradient of part of the batch); ``None``: sample. ``record``: a dict the next
    backward fills with measurements (the token sampling's variance), or ``None``.
    """

    ratios: dict = field(default_factory=dict)
    token_ratio: float = 1.0
    given_rows: torch.Tensor | None = None
    record: dict | None = None
    #: ``False``: every block runs exactly (evaluation, the guard's reference pass)
    active: bool = True
    #: run every block through the row-sampled call even where it keeps every row (a variance check's forward:
    #: its passes then choose the rows)
    force: bool = False

    def kept_rows(self, name: str, weights: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(rows, scale)`` for block ``name`` from its rows' gradient norms ``weights``; ``(None, None)``: all."""
        batch = weights.numel()
        if self.given_rows is not None:
            return self.given_rows.to(weights.device), None
        k = kept_rows_count(self.ratios.get(name, 1.0), batch)
        if k >= batch:
            return None, None
        return select_pairs(ROW_METHOD, weights, k)


def kept_rows_count(ratio: float, batch: int) -> int:
    """How many of ``batch`` samples a block keeps at ``ratio``: ``ratio · batch`` in expectation — its floor, plus
    one with the probability of the fraction (a ratio of 0.98 of 16 samples keeps all 16 most steps and 15 the
    others), so that a ratio between two counts costs and saves what it says; at least 1. Each draw's inclusion
    probabilities sum to its own count, so every draw is unbiased."""
    if ratio >= 1.0 or batch <= 1:
        return batch
    expected = ratio * batch
    whole = int(expected)
    if torch.rand(()).item() < expected - whole:
        whole += 1
    return max(1, min(batch, whole))


def row_norms(grads, batch: int) -> torch.Tensor:
    """Each sample's gradient norm over all of a block's outputs (``None`` gradients skipped), fp32 ``(batch,)``."""
    total = None
    for grad in grads:
        if grad is None:
            continue
        part = squared_norms(grad.reshape(batch, -1), 1)
        total = part if total is None else total + part
    if total is None:
        return torch.zeros(batch)
    return total.sqrt_()


#: where a tensor stands among a call's input leaves (``None`` is a leaf value of its own)
_TENSOR = object()


@dataclass
class _Call:
    """One call of a row-sampled block: how to run it on its flat tensors and put its input back together
    (``out_spec``: its output's, set by the forward)."""

    name: str
    sampler: RowSampler
    run: Callable            # run(*tensors, replay=bool) -> the block's output pytree
    spec: object             # the input pytree's spec
    leaves: tuple            # the input pytree's leaves: non-tensors as they are, tensors as _TENSOR
    batched: tuple           # per tensor: whether its first dimension is the batch
    n_tensors: int
    autocast: tuple          # (device, dtype) regions the forward ran under
    out_spec: object = None


def is_cache(value) -> bool:
    """Whether ``value`` is a key-value cache a block appends to (Hugging Face's ``Cache``, matched by class name so
    that transformers is not imported): state the block changes, which its replay must not touch again."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _unflatten(call: _Call, tensors, replay: bool) -> tuple:
    position = iter(tensors)
    leaves = [next(position) if leaf is _TENSOR else (None if replay and is_cache(leaf) else leaf)
              for leaf in call.leaves]
    return tree_unflatten(leaves, call.spec)


class _RowBlockFunction(torch.autograd.Function):
    """A row-sampled block: forward exact and recorded, backward replayed on the kept rows (module docstring)."""

    @staticmethod
    def forward(ctx, call: _Call, *flat):
        tensors = flat[:call.n_tensors]
        batch = next(t.shape[0] for t, b in zip(tensors, call.batched) if b)
        tape = RowTape(batch)
        with recording(tape):
            output = call.run(*tensors, replay=False)
        outputs, call.out_spec = tree_flatten(output)
        if not all(isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == batch for o in outputs):
            raise RuntimeError(f"fxapprox: row-sampled block {call.name!r} returned something other than tensors "
                               f"whose first dimension is its batch of {batch}")
        ctx.call, ctx.tape, ctx.batch = call, tape, batch
        ctx.save_for_backward(*flat)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        saved = ctx.saved_tensors
        tensors, params = saved[:call.n_tensors], saved[call.n_tensors:]
        batch, sampler = ctx.batch, call.sampler
        present = [g for g in grads if g is not None]
        if not present:
            return (None,) * (1 + len(saved))
        rows, scale = sampler.kept_rows(call.name, row_norms(present, batch))
        ctx.tape.replay(rows, sampler.token_ratio, sampler.record)
        replayed = []
        for tensor, batched in zip(tensors, call.batched):
            value = gather_rows(tensor, rows, batch) if (batched and rows is not None) else tensor
            replayed.append(value.detach().requires_grad_(tensor.requires_grad))
        with torch.enable_grad(), recording(ctx.tape), _autocast(call.autocast):
            # the block gets views of the leaves, not the leaves: module hooks that watch their inputs' gradients
            # (FlopCounterMode's module tracker) cannot follow a leaf inside autograd.grad
            outputs = tree_flatten(call.run(*(t.view_as(t) if t.requires_grad else t for t in replayed),
                                            replay=True))[0]
        pairs = []
        for output, grad in zip(outputs, grads):
            if grad is None or not output.requires_grad:
                continue
            if rows is not None:
                grad = grad.index_select(0, rows)
                if scale is not None:
                    grad = grad * scale.to(grad.dtype).view(-1, *[1] * (grad.dim() - 1))
            pairs.append((output, grad))
        wanted = [t for t in replayed if t.requires_grad] + [p for p in params if p.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        input_grads = []
        for tensor, value, batched in zip(tensors, replayed, call.batched):
            grad = next(found) if value.requires_grad else None
            if grad is not None and batched and rows is not None:
                grad = grad.new_zeros(tensor.shape).index_copy_(0, rows, grad)
            input_grads.append(grad)
        param_grads = [next(found) if p.requires_grad else None for p in params]
        return (None, *input_grads, *param_grads)


@contextlib.contextmanager
def _autocast(regions):
    with contextlib.ExitStack() as stack:
        for device, dtype in regions:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def row_sampled_call(name: str, sampler: RowSampler, run: Callable, args: tuple, kwargs: dict, params,
                     batch: int):
    """Call ``run(*args, **kwargs)`` (a block) with its backward row-sampled by ``sampler`` under ``name``.

    ``params``: the parameters the block uses (their gradients come back through the call); ``batch``: the
    number of samples — every tensor argument whose first dimension has this size is a per-sample input,
    gathered at the kept rows in the replay; others are passed whole (their gradients, where they need one, are
    the kept rows' scaled contributions: unbiased too).
    """
    if batch <= 1:
        return run(*args, **kwargs)   # an empty batch or one sample: nothing to choose among
    if not sampler.force and sampler.ratios.get(name, 1.0) >= 1.0:
        if sampler.token_ratio >= 1.0:
            return run(*args, **kwargs)   # every row and token kept: the plain block, nothing to replay
        with token_sampling(sampler.token_ratio):   # every row kept: the block as it is, its weight gradients sampled
            return run(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    batched = tuple(t.dim() > 0 and t.shape[0] == batch for t in tensors)
    if not any(batched):
        return run(*args, **kwargs)
    regions = tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                    if torch.is_autocast_enabled(device))

    def unflat_run(*flat_tensors, replay: bool):
        # a key-value cache the forward appended to is passed as None to the replay (in training it starts empty
        # each forward, so the replay's attention is the forward's)
        call_args, call_kwargs = _unflatten(call, flat_tensors, replay)
        return run(*call_args, **call_kwargs)

    call = _Call(name=name, sampler=sampler, run=unflat_run, spec=spec,
                 leaves=tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves), batched=batched,
                 n_tensors=len(tensors), autocast=regions)
    outputs = _RowBlockFunction.apply(call, *tensors, *(p for p in params if p.requires_grad))
    return tree_unflatten(list(outputs), call.out_spec)


def sampling(sampler: RowSampler | None) -> bool:
    """Whether a row block samples now: a sampler in force and autograd recording."""
    return sampler is not None and sampler.active and torch.is_grad_enabled()


def batch_of(values) -> int:
    """The batch: the first dimension of the tensor argument with the most dimensions (at least two; the first of
    those): a block's activations (B, T, D), not a (T, S) attention mask passed before them."""
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2]
    return max(tensors, key=lambda v: v.dim()).shape[0] if tensors else 0


class RowSampledBlock(nn.Module):
    """A traced block run as one unit whose backward is row-sampled (``fxapprox.passes.rewrite_rows``).

    ``code`` takes the block's modules (``n_modules``), its ``get_attr`` values (``n_attributes``) and its
    activations, and returns its outputs as a tuple. It owns nothing: modules and parameters arrive as arguments.
    """

    def __init__(self, graph: torch.fx.Graph, block: str, sampler: RowSampler, n_modules: int,
                 n_attributes: int) -> None:
        super().__init__()
        self.block = block
        self.n_modules, self.n_attributes = n_modules, n_attributes
        self.code = torch.fx.GraphModule(nn.Module(), graph, class_name="Block")
        self.__dict__["sampler"] = sampler   # shared with the model, not a submodule

    def forward(self, *inputs):
        if not sampling(self.sampler):
            return self.code(*inputs)
        modules = inputs[:self.n_modules]
        attributes = inputs[self.n_modules:self.n_modules + self.n_attributes]
        params = [p for m in modules for p in m.parameters()] + [a for a in attributes if isinstance(a, nn.Parameter)]
        batch = batch_of(inputs[self.n_modules + self.n_attributes:])
        return row_sampled_call(self.block, self.sampler, self.code, inputs, {}, params, batch)

    def extra_repr(self) -> str:
        return f"block={self.block!r}"
