"""Measurement — whether each row block (``fxapprox.passes.analysis.row_blocks``) may be row-sampled, probed on
the example batch.

Row sampling replays a block on the samples it keeps (``fxapprox.ops.rows``). That gives the gradient of the kept
samples only when the block treats its samples independently and computes the same thing twice. Each block is
run on the example batch in training mode, twice, and once on a subset of its samples; it qualifies when

* its outputs are tensors whose first dimension is the batch (the rows sampled),
* the two runs agree (no dropout or other random draws: the replay would draw differently), and
* the subset's outputs are the full run's outputs for those samples (no BatchNorm in training, no reduction over
  the batch: the kept rows' gradient would not be theirs).

A block that fails gets the reason as its blocker, which the plan and the report show. Buffers, RNG and modes are
left as they were (the probes run in the analysis sandbox).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from fxapprox.ops.rows import batch_of, is_cache
from fxapprox.passes.analysis.row_blocks import ROW_BLOCKS_KEY, RowBlock, row_blocks_of, with_blocker

__all__ = ["BlockRun", "eager_block_runs", "forward_disruption", "probe_row_block", "probe_row_blocks",
           "block_parameters", "row_time_breakeven", "token_breakeven", "traced_block_runs"]

#: relative tolerance of the subset probe (float sums in another order differ by rounding only)
_RTOL = 1e-4


@dataclass
class BlockRun:
    """How to run one block on the example batch: ``run(*args, **kwargs)`` and the batch size."""

    run: object
    args: tuple
    kwargs: dict
    batch: int


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=_RTOL, atol=_RTOL * max(scale, 1e-6)))


def probe_row_block(run: BlockRun) -> str | None:
    """Why the block ``run`` runs cannot be row-sampled, or ``None`` (see the module docstring)."""
    batch = run.batch
    if batch < 2:
        return f"a batch of {batch} sample: nothing to sample"
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(batch, generator=generator)[: max(1, batch // 2)].sort().values

    def gathered(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return None if is_cache(value) else value

    # a key-value cache is not the probe's to append to (the replay passes none either)
    args, kwargs = tree_map(lambda v: None if is_cache(v) else v, (run.args, run.kwargs))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        first = tree_flatten(run.run(*args, **kwargs))[0]
        torch.manual_seed(12)
        again = tree_flatten(run.run(*args, **kwargs))[0]
        if not first or not all(isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == batch for o in first):
            return "returns something other than tensors whose first dimension is the batch"
        if not all(_close(a, b) for a, b in zip(again, first)):
            return ("draws random numbers in training (dropout): its replay on the kept rows would draw other ones; "
                    "set the dropout to 0 to sample its rows")
        torch.manual_seed(11)
        subset = tree_flatten(run.run(*tree_map(gathered, args), **tree_map(gathered, kwargs)))[0]
    if len(subset) != len(first) or not all(_close(s, f.index_select(0, rows.to(f.device)))
                                            for s, f in zip(subset, first)):
        return ("mixes its samples (BatchNorm in training, a reduction over the batch): a subset of the samples "
                "does not give their outputs")
    return None


def probe_row_blocks(gm: torch.fx.GraphModule, runs: dict[str, BlockRun], unrunnable: dict[str, str]) -> list[RowBlock]:
    """Probe every row block of ``gm`` (:func:`probe_row_block` on ``runs[name]``; ``unrunnable[name]``: why a
    block cannot be called as one unit) and write the blockers into ``gm.meta``."""
    blocks = []
    for block in row_blocks_of(gm):
        reason = unrunnable.get(block.name)
        if reason is None and block.name in runs:
            reason = probe_row_block(runs[block.name])
        blocks.append(with_blocker(block, reason))
    gm.meta[ROW_BLOCKS_KEY] = blocks
    return blocks


class _Values(torch.fx.Interpreter):
    """Runs the graph and keeps the values of the nodes asked for."""

    def __init__(self, gm, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, n):
        value = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = value
        return value


def traced_block_runs(gm: torch.fx.GraphModule, inputs: tuple) -> tuple[dict[str, BlockRun], dict[str, str]]:
    """``(runs, unrunnable)`` for the row blocks of a traced model: each contiguous block as a function of its
    inputs (``fxapprox.passes.rewrite_rows.block_unit``), called on the values the example batch gives them."""
    from fxapprox.passes.rewrite_rows import block_unit

    runs, unrunnable, units = {}, {}, {}
    for block in row_blocks_of(gm):
        if not block.contiguous:
            unrunnable[block.name] = "its nodes are not one contiguous run of the graph"
            continue
        units[block.name] = block_unit(gm, block)
    wanted = {name for unit in units.values() for name in unit.inputs}
    interpreter = _Values(gm, wanted)
    with torch.no_grad():
        interpreter.run(*inputs)
    for name, unit in units.items():
        values = [interpreter.values[i] for i in unit.inputs]
        args = unit.call_args(gm, values)
        batch = batch_of(values)   # the inputs' (the block's parameters come first in args: a packed weight is 2-D)
        runs[name] = BlockRun(unit.code, args, {}, batch)
    return runs, unrunnable


def eager_block_runs(model, gm: torch.fx.GraphModule, received: dict) -> tuple[dict[str, BlockRun], dict[str, str]]:
    """``(runs, unrunnable)`` for the row blocks of a model captured region by region (``gm`` its stitched
    planning graph): each block's module, called on what it received in the recorded step
    (``fxapprox.passes.capture.regions.record_calls``)."""
    runs, unrunnable = {}, {}
    for block in row_blocks_of(gm):
        record = received.get(block.name)
        if record is None:
            unrunnable[block.name] = "its module was not called in the recorded step"
            continue
        if record.calls != 1:
            unrunnable[block.name] = f"its module is called {record.calls} times in one forward"
            continue
        values = list(record.args) + list(record.kwargs.values())
        batch = batch_of(values)
        runs[block.name] = BlockRun(model.get_submodule(block.name), tuple(record.args), dict(record.kwargs), batch)
    return runs, unrunnable


class _SampledForwards(TorchFunctionMode):
    """Every ``F.linear`` on a parameter weight with at least ``min_channels`` inputs computed by forward top-k,
    keeping ``keep_ratio`` of its input features (the probe of :func:`forward_disruption`)."""

    def __init__(self, keep_ratio: float, min_channels: int) -> None:
        super().__init__()
        self.keep_ratio, self.min_channels = keep_ratio, min_channels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from fxapprox.op_kinds.registry import LINEAR_TARGETS, linear_call_args
        from fxapprox.ops.linear import sampled_linear
        from fxapprox.ops.sampling import kept_count

        kwargs = kwargs or {}
        if func in LINEAR_TARGETS:
            x, weight, bias = linear_call_args(tuple(args), dict(kwargs))
            if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[1] >= self.min_channels:
                return sampled_linear(x, weight, bias, kept_count(self.keep_ratio, weight.shape[1]), "topk")
        return func(*args, **kwargs)


def _logits(output):
    """The model's predictions: a ``logits`` entry where the output has one (Hugging Face's, beside its loss),
    else its first tensor."""
    from fxapprox.pipeline._projection import first_tensor

    if isinstance(output, dict) or hasattr(output, "keys"):
        if "logits" in output.keys():
            return output["logits"]
    return first_tensor(output)


def forward_disruption(call, keep_ratio: float, min_channels: int) -> float | None:
    """How much sampling the forward changes what the model predicts: ``KL(p_exact ‖ p_sampled)`` of the softmax of
    its outputs (nats, mean over the output's rows), every linear layer's forward top-k at ``keep_ratio``
    (``call()`` runs the model on the example batch, in training mode). Near 0 for a model at its initial weights
    (its predictions are near-uniform whatever the forward does); large for a trained one (its confident predictions
    move). ``None`` when the output is not a floating tensor of scores (last dimension at least 2)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        exact = _logits(call())
        torch.manual_seed(0)
        with _SampledForwards(keep_ratio, min_channels):
            sampled = _logits(call())
    if not (isinstance(exact, torch.Tensor) and exact.is_floating_point() and exact.dim() >= 1
            and exact.shape[-1] >= 2 and isinstance(sampled, torch.Tensor) and sampled.shape == exact.shape):
        return None
    reference, moved = F.log_softmax(exact.float(), -1), F.log_softmax(sampled.float(), -1)
    return float((reference.exp() * (reference - moved)).sum(-1).mean())


def _interleaved_seconds(runs: dict, repeats: int, device: torch.device) -> dict:
    """Each of ``runs`` (name → callable) timed ``repeats`` times, interleaved round by round after one warm-up
    round (the machine's speed drifts between rounds far more than within one): the seconds of each, per round."""
    import time

    timings = {name: [] for name in runs}
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index:
                timings[name].append(time.perf_counter() - start)
    return timings


def token_breakeven(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device,
                    cache=None, repeats: int = 9) -> float:
    """The token ratio below which a weight gradient sampled over its tokens (``sampled_rows_product``: leverage
    scores, PPS, the kept rows gathered) is faster than the whole product ``dYᵀ·X`` of a ``rows × in_features``
    input and ``rows × out_features`` output gradient: the sampled product timed at ratio 1/2 against the whole one
    (interleaved, medians), its fixed cost (scores, selection, gathers) read off as ``t(½) − ½·t(1)``, and the ratio
    where ``ν·t(1) + fixed = t(1)``. ``cache`` (a :class:`~fxapprox.pipeline.timing_cache.TimingCache`) keeps it per
    machine, so plans stay the same run after run."""
    from fxapprox.ops.linear import sampled_rows_product

    key = f"token breakeven:{rows}x{in_features}x{out_features}:{dtype}"
    if cache is not None and cache.get(key) is not None:
        return cache.get(key)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(device=device, dtype=dtype)
    grad = torch.randn(rows, out_features, generator=generator).to(device=device, dtype=dtype)
    runs = {"whole": lambda: grad.t() @ x, "half": lambda: sampled_rows_product(grad, x, 0.5, "pps")}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        seconds = _interleaved_seconds(runs, repeats, device)
    whole, half = statistics.median(seconds["whole"]), statistics.median(seconds["half"])
    breakeven = min(1.0, max(0.0, 1.0 - (half - 0.5 * whole) / whole)) if whole > 0 else 0.0
    if cache is not None:
        cache.put(key, breakeven)
        cache.save()
    return breakeven


def block_parameters(run: BlockRun) -> list[torch.Tensor]:
    """The trainable parameters a block run uses: its module's, or (a traced block's code) those of the modules and
    the parameters among its arguments."""
    found, seen = [], set()
    for value in (run.run, *run.args):
        tensors = value.parameters() if isinstance(value, nn.Module) else ([value] if isinstance(value, nn.Parameter)
                                                                           else [])
        for tensor in tensors:
            if tensor.requires_grad and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
    return found


def row_time_breakeven(run: BlockRun, cache=None, repeats: int = 4) -> float:
    """The keep-ratio below which a row-sampled training step of the block ``run`` runs (forward without autograd,
    recorded; backward replayed on the kept rows: ``fxapprox.ops.rows``) is faster than its plain one, on this
    machine: the block's forward and backward timed plainly (``t_e``), row-sampled keeping every row (``t_1``: the
    replay's whole cost) and keeping half (``t_½``), interleaved, medians; the step's time taken as linear in the
    ratio, ``t(r) = t_1 − (t_1 − t_½)·(1 − r)/½``, and the ratio where it meets ``t_e`` (each time a median of
    per-round ratios to ``t_e``). The FLOP break-even
    (``RowBlock.breakeven``) misses what the replay costs beyond FLOPs: a forward run twice on the kept rows' cheap
    ops, the gathers, the Python of the replay. ``cache`` keeps it per machine and block shape."""
    from fxapprox.ops.rows import RowSampler, row_sampled_call

    params = block_parameters(run)
    leaves = tree_flatten((run.args, run.kwargs))[0]
    shapes = [tuple(v.shape) for v in leaves if isinstance(v, torch.Tensor)] + [tuple(p.shape) for p in params]
    key = f"row breakeven:{type(run.run).__name__}:{run.batch}:{hash(tuple(shapes))}"
    if cache is not None and cache.get(key) is not None:
        return cache.get(key)
    args, kwargs = tree_map(lambda v: None if is_cache(v) else v, (run.args, run.kwargs))
    args, kwargs = tree_map(lambda v: v.detach().requires_grad_() if isinstance(v, torch.Tensor)
                            and v.is_floating_point() and v.dim() >= 2 and v.shape[0] == run.batch else v,
                            (args, kwargs))
    inputs = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor) and v.requires_grad]
    wanted = inputs + params
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.no_grad():
            outputs = [o for o in tree_flatten(run.run(*args, **kwargs))[0]
                       if isinstance(o, torch.Tensor) and o.is_floating_point()]
        grads = [torch.randn_like(o) for o in outputs]

        def step(sampler: RowSampler | None):
            def call():
                if sampler is None:
                    out = run.run(*args, **kwargs)
                else:
                    out = row_sampled_call("block", sampler, run.run, args, kwargs, params, run.batch)
                found = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
                torch.autograd.grad(found, wanted, grads, allow_unused=True)
            return call

        device = wanted[0].device if wanted else torch.device("cpu")
        seconds = _interleaved_seconds({"exact": step(None), "whole": step(RowSampler({"block": 1.0}, force=True)),
                                        "half": step(RowSampler({"block": 0.5}))}, repeats, device)
    # per-round ratios to the plain step (paired: steadier than ratios of medians)
    whole = statistics.median(w / e for w, e in zip(seconds["whole"], seconds["exact"]))
    half = statistics.median(h / e for h, e in zip(seconds["half"], seconds["exact"]))
    if whole <= 1.0:
        breakeven = 1.0
    elif whole <= half:
        breakeven = 0.0
    else:
        breakeven = min(1.0, max(0.0, 1.0 - 0.5 * (whole - 1.0) / (whole - half)))
    if cache is not None:
        cache.put(key, breakeven)
        cache.save()
    return breakeven
