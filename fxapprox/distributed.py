"""Sampled-gradient AllReduce for ``DistributedDataParallel``: approximated layers send less.

A forward-sampled ``Linear``/``Conv2d`` keeps ``k`` of its ``n`` input columns
(channels), so its weight gradient is exactly zero outside those ``k`` slices.
If every rank keeps *the same* slices, only they need to be all-reduced: the
rest is zero everywhere. :func:`register_sampled_allreduce` makes the choice
identical on every rank without any extra communication:

* the scores are ``‖W[:, i]‖ · ā_i``: the weight's column (channel) norms, which are
  bit-identical on every rank after each synchronised step, times ``ā``, the input
  column norms of the *previous* step averaged over ranks — they ride in the same
  all-reduce as the gradients (``n`` floats per layer, counted in ``bytes_sent``), so
  every rank holds the same ``ā`` without a collective in the forward. The first
  step uses the weight norms alone;
* the random part of the selection (top-k's ``random_share``, CRS and
  Bernoulli draws) runs under a generator seeded from a seed broadcast by rank 0,
  the layer's index and its call count, so every rank draws the same numbers.

The DDP communication hook then packs, per bucket, the kept slices of the
sampled weights plus every other gradient whole into one flat tensor, all-reduces
it (averaged, as DDP does), and writes it back — zeros outside the kept slices.
BatchNorm buffers are left to DDP (``broadcast_buffers``), parameters that are not
approximated are reduced in full.

Each rank must call the approximated layers the same number of times per step
(the same condition DDP itself needs without ``find_unused_parameters``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fxapprox.ops.conv import channel_squared_norms, conv2d_with_channels
from fxapprox.ops.linear import _nonempty, linear_with_pairs, squared_norms
from fxapprox.ops.sampling import select_pairs
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear, ApproxOp

__all__ = ["RankSyncedSelection", "SampledAllReduceState", "plan_fingerprint", "register_sampled_allreduce"]


class RankSyncedSelection:
    """Chooses a sampled layer's kept pairs from rank-identical state only, and logs them for the hook."""

    def __init__(self, seed: int, layer_index: int) -> None:
        self.seed = seed
        self.layer_index = layer_index
        self.calls = 0
        self.kept_log: list[torch.Tensor] = []
        #: input column sq-norms averaged over ranks at the last all-reduce (identical on every rank)
        self.synced_input_norms: torch.Tensor | None = None
        #: this rank's input column sq-norms since the last all-reduce (sent with the gradients)
        self.pending_input_norms: torch.Tensor | None = None

    def _scores(self, weight_squared: torch.Tensor, input_squared: torch.Tensor) -> torch.Tensor:
        pending = self.pending_input_norms
        self.pending_input_norms = input_squared if pending is None else pending + input_squared
        if self.synced_input_norms is None:
            return weight_squared.sqrt_()
        return (weight_squared * self.synced_input_norms).sqrt_()

    def _select(self, spec, scores: torch.Tensor):
        deterministic = spec.method == "topk" and spec.random_share == 0
        if deterministic:
            kept, scale = select_pairs(spec.method, scores, spec.k, spec.random_share)
        else:
            devices = [scores.device] if scores.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed((self.seed * 1_000_003 + self.layer_index * 7_919 + self.calls) % (2 ** 63))
                kept, scale = select_pairs(spec.method, scores, spec.k, spec.random_share)
        self.calls += 1
        kept, scale = _nonempty(kept, scale, scores)
        self.kept_log.append(kept)
        return kept, scale

    def linear(self, module: ApproxLinear, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scores = self._scores(squared_norms(module.weight, 0), squared_norms(x.reshape(-1, x.shape[-1]), 0))
        kept, scale = self._select(module.fxapprox_spec, scores)
        return linear_with_pairs(x, module.weight, module.bias, kept, scale, module.fxapprox_spec.save_input)

    def conv2d(self, module: ApproxConv2d, x: torch.Tensor, padding) -> torch.Tensor:
        with torch.no_grad():
            scores = self._scores(squared_norms(module.weight, (0, 2, 3)), channel_squared_norms(x))
        kept, scale = self._select(module.fxapprox_spec, scores)
        return conv2d_with_channels(x, module.weight, module.bias, kept, scale, module.stride, padding,
                                    module.dilation, module.fxapprox_spec.save_input)

    def consume(self) -> torch.Tensor | None:
        """The sorted union of the slices kept since the last call (``None``: the layer did not sample)."""
        if not self.kept_log:
            return None
        kept = self.kept_log[0] if len(self.kept_log) == 1 else torch.cat(self.kept_log).unique(sorted=True)
        self.kept_log = []
        return kept


@dataclass
class SampledAllReduceState:
    """What the hook needs and what it counted (bytes are per rank, cumulative)."""

    process_group: object
    world_size: int
    #: id(parameter) → (its layer's selection, the weight dimension the kept indices index)
    sampled: dict = field(repr=False)
    #: what the gradients travel in (``None``: the parameters' own dtype)
    dtype: torch.dtype | None = None
    bytes_sent: int = 0
    bytes_dense: int = 0
    buckets: int = 0

    @property
    def sent_ratio(self) -> float:
        """``bytes_sent / bytes_dense`` so far (1.0 before anything was sent)."""
        return self.bytes_sent / self.bytes_dense if self.bytes_dense else 1.0


def plan_fingerprint(approx) -> str:
    """A SHA-256 of the approximated module's decisions (which layer keeps how many of which pairs, how),
    identical on ranks that planned the same; the measurements behind them (times, errors) are left out."""
    decisions = [(d.node, d.approximate, d.method, d.mode, d.k, d.n, d.random_share) for d in approx.plan.layers]
    return hashlib.sha256(json.dumps(decisions).encode()).hexdigest()


def _check_plans_agree(approx, group) -> None:
    digest = int(plan_fingerprint(approx)[:15], 16)   # 60 bits: fits an int64 tensor
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    digests = [int(t.item()) for t in everyone]
    if len(set(digests)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(digests):
            groups.setdefault(value, []).append(rank)
        described = "; ".join(f"ranks {ranks} share plan {value:015x}" for value, ranks in groups.items())
        raise ValueError("register_sampled_allreduce: the ranks' plans differ, so they would keep different "
                         f"slices ({described}); approximate with the same budget, method, memory_budget and config "
                         "on every rank (then every rank trains with rank 0's plan)")


def _sampled_hook(state: SampledAllReduceState, bucket):
    # No return annotation: DDP rejects the string form that ``from __future__ import annotations`` makes.
    buffer = bucket.buffer()
    pieces: list[torch.Tensor] = []
    writes: list = []   # one per piece: puts its reduced slice back
    offset = 0
    for param in bucket.parameters():
        view = buffer[offset:offset + param.numel()].view(param.shape)
        offset += param.numel()
        entry = state.sampled.get(id(param))
        kept = entry[0].consume() if entry is not None else None
        if kept is None:
            pieces.append(view.reshape(-1))
            writes.append(lambda reduced, view=view: view.copy_(reduced.view(view.shape)))
        else:
            selection, dim = entry
            piece = view.index_select(dim, kept)
            pieces.append(piece.reshape(-1))
            # Outside ``kept`` the local gradient is already exactly zero on every rank: no zero_() needed.
            writes.append(lambda reduced, view=view, dim=dim, kept=kept, shape=piece.shape:
                          view.index_copy_(dim, kept, reduced.view(shape)))
            norms, selection.pending_input_norms = selection.pending_input_norms, None
            pieces.append(norms.to(buffer.dtype))
            # the averaged input norms: the next step's scores
            writes.append(lambda reduced, selection=selection:
                          setattr(selection, "synced_input_norms", reduced.float().clone()))
    if offset != buffer.numel():
        raise RuntimeError(f"DDP bucket layout not understood: parameters cover {offset} of {buffer.numel()} "
                           "elements")
    flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
    sizes = [piece.numel() for piece in pieces]
    del pieces
    low_precision = state.dtype is not None and state.dtype != flat.dtype
    if low_precision:
        # As DDP's bf16_compress_hook: averaged before the sum, so that it cannot overflow the narrow type.
        flat = flat.to(state.dtype).div_(state.world_size)
    state.bytes_sent += flat.numel() * flat.element_size()
    state.bytes_dense += buffer.numel() * buffer.element_size()
    state.buckets += 1
    future = dist.all_reduce(flat, group=state.process_group, async_op=True).get_future()

    def unpack(done) -> torch.Tensor:
        reduced = done.value()[0]
        # Every rank receives the same reduced values and widens them the same way: replicas stay identical.
        reduced = reduced.to(buffer.dtype) if low_precision else reduced.div_(state.world_size)
        for write, part in zip(writes, reduced.split(sizes)):
            write(part)
        return buffer

    return future.then(unpack)


def _is_fsdp(module) -> bool:
    """A module wrapped by FSDP: ``FullyShardedDataParallel`` or ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:   # pragma: no cover - builds without distributed
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # torch < 2.6
        FSDPModule = ()
    return isinstance(module, (FullyShardedDataParallel, FSDPModule))


def register_sampled_allreduce(ddp: nn.parallel.DistributedDataParallel, *, process_group=None,
                               seed: int | None = None, dtype: torch.dtype | None = None) -> SampledAllReduceState:
    """Register the sampled-gradient AllReduce communication hook on ``ddp``; returns its state.

    ``ddp`` must wrap a module made by :func:`fxapprox.approximate` (already planned: pass
    ``example_inputs``). The plans of all ranks are compared once (an all-gather of a hash);
    from then on forward-sampled ``Linear``/``Conv2d`` layers choose their slices from the
    weights and a shared seed, and only those slices of their weight gradients are sent.
    ``state.bytes_sent`` / ``state.bytes_dense`` count what was all-reduced vs what plain
    DDP would have sent.

    ``dtype`` (e.g. ``torch.bfloat16``): the kept slices, the exact layers' gradients and the
    input norms travel in that type and are averaged back into the parameters' type, as DDP's
    ``bf16_compress_hook`` does for plain DDP (half the bytes again; every rank receives and
    widens the same values, so replicas stay identical). ``None`` (default): full precision.

    DDP only: FSDP (``fully_shard``) reduce-scatters gradient shards, not whole gradients, and
    an approximated model trains under it with every gradient sent in full.

    Example::

        >>> approx = fxapprox.approximate(model, budget=0.5, example_inputs=(x,))
        >>> ddp = torch.nn.parallel.DistributedDataParallel(approx)
        >>> state = fxapprox.distributed.register_sampled_allreduce(ddp, dtype=torch.bfloat16)
        >>> ...  # train as usual
        >>> print(f"sent {state.sent_ratio:.0%} of plain DDP's gradient bytes")
    """
    from fxapprox.api import ApproxGraphModule

    if not isinstance(ddp, nn.parallel.DistributedDataParallel):
        if _is_fsdp(ddp):
            raise TypeError("register_sampled_allreduce works with DistributedDataParallel only: FSDP "
                            f"({type(ddp).__name__}) reduce-scatters gradient shards, so there is no whole "
                            "gradient to send in slices. The approximated model trains under FSDP as it is, with "
                            "full gradients; use DistributedDataParallel(approx) for the sampled AllReduce")
        raise TypeError(f"ddp must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    approx = ddp.module
    from fxapprox.runtime.model import ApproxRuntime

    if isinstance(approx, ApproxRuntime) and not isinstance(approx, ApproxGraphModule):
        raise TypeError(f"register_sampled_allreduce needs a model torch.fx traces whole; {type(approx).__name__} was "
                        "captured region by region (its own code does not trace). Train it under DDP with full "
                        "gradient AllReduce (no hook), or trace it yourself and approximate the GraphModule")
    if not isinstance(approx, ApproxGraphModule):
        raise TypeError("ddp must wrap a module returned by fxapprox.approximate, got "
                        f"{type(approx).__name__}; use DistributedDataParallel(fxapprox.approximate(model, ...))")
    if getattr(ddp, "find_unused_parameters", False):
        raise ValueError("register_sampled_allreduce needs find_unused_parameters=False: every rank must run the "
                         "same approximated layers each step so that they keep the same slices")
    group = process_group if process_group is not None else dist.group.WORLD
    approx.plan  # noqa: B018 — raises PlanNotReadyError with its own advice when not planned yet
    _check_plans_agree(approx, group)
    if seed is None:
        shared = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
        dist.broadcast(shared, src=dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0,
                       group=group)
        seed = int(shared.item())
    sampled: dict = {}
    for index, (_, module) in enumerate(approx.named_modules()):
        if isinstance(module, (ApproxLinear, ApproxConv2d)) and module.fxapprox_spec.mode == "forward":
            module.fxapprox_sync = RankSyncedSelection(seed, index)
            sampled[id(module.weight)] = (module.fxapprox_sync, 1)   # kept indices index weight dim 1 (inputs)
        elif isinstance(module, ApproxOp):
            module.fxapprox_sync = None   # backward sampling and LSTMs: full-size weight gradients
    state = SampledAllReduceState(group, dist.get_world_size(group), sampled, dtype=dtype)
    ddp.register_comm_hook(state, _sampled_hook)
    return state
