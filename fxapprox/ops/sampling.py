"""Column-row pair selection: the part of CRS that decides *which* pairs to keep.

A selector takes the importance score of every pair (``w_i = ‖A[:, i]‖·‖B[i, :]‖``,
shape ``(n,)``), the number ``k`` of pairs to keep and the ``random_share`` of
``k`` to draw uniformly (top-k's guard against starving a column), and returns
the kept indices (sorted ascending, so the gathers that follow walk memory in
order) and, for the unbiased estimators, a per-kept-pair scale (``None`` when
no scaling is applied). Selectors are registered by name; ``method=`` on
:func:`fxapprox.approximate` picks one.

Every selector but ``bernoulli`` keeps exactly ``min(k, n)`` pairs and never reads a
device value on the host: the sampled op's shapes are fixed by the plan, so a training
step neither waits on the GPU nor breaks a ``torch.compile`` graph (``crs`` and
``wta_crs`` draw by systematic PPS sampling, :func:`systematic_sample`). ``bernoulli``
keeps a random number of pairs by design; ``method="auto"`` never picks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from fxapprox._validate import check_share
from fxapprox.ops.training_context import current

Selector = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]

METHODS: dict[str, Selector] = {}

#: weight of the uniform distribution mixed into CRS probabilities (the papers' code uses 0.1)
CRS_UNIFORM_MIX = 0.1


def kept_count(ratio: float, n: int) -> int:
    """How many of a layer's ``n`` column-row pairs a plan keeps at keep-ratio ``ratio``: the most the ratio
    allows (floor; at least 1). The plan's ``k``; a sampled op given ``k`` keeps exactly it."""
    return max(1, min(n, math.floor(ratio * n + 1e-9)))


def rounded_count(ratio: float, m: int) -> int:
    """How many of ``m`` entries a sampled op keeps when it applies a plan's keep-ratio ``k / n`` to another
    dimension (a backward-sampled layer's batch rows or outputs) or receives only the ratio (an LSTM's hidden
    units, where ``m == n`` and this is ``k`` again): nearest (at least 1)."""
    return max(1, min(m, round(ratio * m)))


def register_method(name: str) -> Callable[[Selector], Selector]:
    """Register a pair selector ``(scores, k, random_share) -> (kept, scale)`` under ``name``."""

    def decorator(selector: Selector) -> Selector:
        if name in METHODS:
            raise ValueError(f"sampling method {name!r} is already registered")
        METHODS[name] = selector
        return selector

    return decorator


@register_method("topk")
def select_topk(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, None]:
    """top-k-CRS: keep the ``k`` pairs with the largest scores, unscaled (biased).

    With ``random_share > 0``, ``round(random_share * k)`` of the ``k`` slots go to
    pairs drawn uniformly from those not in the top group, so that no column is
    starved forever (a never-picked weight column would never get a gradient).
    """
    n = scores.numel()
    k = min(k, n)
    explore = min(int(round(random_share * k)), n - k) if random_share > 0 else 0
    top = torch.topk(scores, k - explore, sorted=False).indices
    if explore:
        # a uniform draw without replacement among the others: the largest of i.i.d. uniform keys (half the
        # time of torch.multinomial without replacement, the same distribution)
        keys = torch.rand(n, device=scores.device)
        keys[top] = -1.0
        top = torch.cat([top, torch.topk(keys, explore, sorted=False).indices])
    return top.sort().values, None


def crs_probabilities(scores: torch.Tensor) -> torch.Tensor:
    """CRS sampling distribution: ``p ∝ w`` mixed with a uniform floor (uniform when all w = 0)."""
    n = scores.numel()
    total = scores.sum()
    proportional = torch.where(total > 0, scores / total.clamp_min(torch.finfo(scores.dtype).tiny),
                               torch.full_like(scores, 1.0 / n))
    return (1.0 - CRS_UNIFORM_MIX) * proportional + CRS_UNIFORM_MIX / n


def inclusion_probabilities(weights: torch.Tensor, k: int, target: torch.Tensor | float | None = None) -> torch.Tensor:
    """``π_i = min(1, c·w_i)`` with ``c`` chosen so that ``Σ π_i = target`` (default ``k``; a tensor is allowed,
    at most ``k``), the clamped mass redistributed; pairs with ``w_i = 0`` get 0 (all kept surely when fewer
    than ``target`` are positive), and every pair ``target / n`` when all are 0. No host synchronisation.

    With the weights sorted descending, if the ``m`` largest are clamped to 1 the rest share ``target − m``:
    ``c = (target − m) / Σ_{j≥m} w_j``; the right ``m`` is the smallest for which the largest unclamped weight
    satisfies ``c·w_m ≤ 1`` (or nothing positive is left).
    """
    w = weights.float()
    n = w.numel()
    if target is None and k >= n:
        return torch.ones_like(w)
    goal = torch.as_tensor(k if target is None else target, dtype=w.dtype, device=w.device)
    bound = min(k, n - 1)   # at most this many can be clamped (Σ π ≤ k)
    ordered, order = torch.sort(w, descending=True)
    tail = ordered.flip(0).cumsum(0).flip(0)[: bound + 1]                  # Σ_{j≥m} w_j
    clamped = torch.arange(bound + 1, device=w.device, dtype=w.dtype)
    scale = (goal - clamped) / tail.clamp_min(torch.finfo(w.dtype).tiny)
    fits = (scale * ordered[: bound + 1] <= 1.0 + 1e-6) | (tail <= 0)
    m = torch.argmax(fits.to(torch.int8)).view(1)                          # the first m that fits (a tensor)
    c = torch.where(tail.index_select(0, m) > 0, scale.index_select(0, m), 0.0)   # not tail[m]: a host read
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(n, device=w.device)
    probabilities = torch.where(ranks < m, torch.ones_like(w), torch.clamp(c * w, max=1.0))
    return torch.where(w.sum() > 0, probabilities, (goal / n).expand(n))


#: ``bernoulli_probabilities(scores, k)``: Bernoulli-CRS's keep probabilities (the same as PPS sampling's)
bernoulli_probabilities = inclusion_probabilities


def systematic_sample(probabilities: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` distinct pairs, pair ``i`` kept with probability ``π_i`` exactly (``Σ π = k``, each ``π_i ≤ 1``),
    scaled by ``1 / π_i`` (Horvitz–Thompson: unbiased); returned sorted. Static shapes, no host synchronisation.

    Systematic PPS sampling: the pairs, in a random order, lay out intervals of length ``π_i`` end to end; the
    points ``u, u + 1, …, u + k − 1`` (``u`` uniform in [0, 1)) pick the pairs whose intervals they fall in. An
    interval no longer than 1 holds at most one point, so the ``k`` pairs are distinct, and it holds one with
    probability equal to its length. Where fewer than ``k`` pairs can be kept (``Σ π < k``: fewer pairs carry any
    weight), the slots past the total get scale 0.
    """
    picked, scale = _systematic(probabilities, k)
    kept, by_index = picked.sort()
    return kept, scale[by_index]


def _systematic(probabilities: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`systematic_sample`'s draw, unsorted: ``(picked positions, their scales)``."""
    n = probabilities.numel()
    device = probabilities.device
    order = torch.randperm(n, device=device)
    ends = torch.cumsum(probabilities[order].double(), 0)
    points = torch.arange(k, device=device, dtype=torch.float64).add_(torch.rand((), device=device,
                                                                                 dtype=torch.float64))
    position = torch.searchsorted(ends, points, right=True).clamp_(max=n - 1)
    picked = order[position]
    scale = probabilities[picked].clamp_min(torch.finfo(torch.float32).tiny).reciprocal_()
    return picked, torch.where(points < ends[-1], scale, 0.0).to(torch.float32)


def _sorted_inclusion(ordered: torch.Tensor, k: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """Inclusion probabilities of non-negative weights sorted descending (``ordered``, ``k < n``): the first ``m``
    pairs kept surely (``π = 1``), the others ``π = (k − m)·w / Σ_{j≥m} w``, ``m`` the smallest (at least
    ``first``) for which no other ``π`` passes 1 — :func:`inclusion_probabilities` computed where the weights are
    already in order (one sort instead of two, and no rank scatter: the selectors' cost is their op count).
    Pairs past an all-zero tail get 0."""
    n = ordered.numel()
    tail = ordered.flip(0).cumsum(0).flip(0)[: k + 1]                        # Σ_{j≥m} w_j for m = 0..k
    clamped = torch.arange(k + 1, device=ordered.device, dtype=ordered.dtype)
    fits = ((k - clamped) * ordered[: k + 1] <= (1.0 + 1e-6) * tail) | (tail <= 0)
    if first is not None:
        fits &= clamped >= first
    m = torch.argmax(fits.to(torch.int8)).view(1)                          # the first m that fits (a tensor)
    mass = tail.index_select(0, m)                                         # not tail[m]: a host read
    scale = torch.where(mass > 0, (k - m) / mass.clamp_min(torch.finfo(ordered.dtype).tiny), 0.0)
    positions = torch.arange(n, device=ordered.device)
    return torch.where(positions < m, 1.0, (scale * ordered).clamp_(max=1.0))


#: whether CRS and WTA-CRS select on CPU tensors in NumPy (:func:`_sample_sorted_cpu`); the torch path, which every
#: other device takes, stays sync-free and compiles (the tests switch this off to check it on a CPU)
CPU_NUMPY = True


def _sample_sorted(weights: torch.Tensor, k: int, winners: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Systematic PPS sampling of ``k < n`` pairs with :func:`_sorted_inclusion`'s probabilities of ``weights``
    (non-negative fp32, not all zero); with ``winners``, WTA-CRS's winners (:func:`wta_crs_split`) are kept surely
    at the least. ``(kept sorted, scales)``."""
    if weights.device.type == "cpu" and CPU_NUMPY and not torch.compiler.is_compiling():
        return _sample_sorted_cpu(weights, k, winners)
    ordered, order = torch.sort(weights, descending=True)
    first = wta_crs_split(ordered / ordered.sum(), k) if winners else None
    picked, scale = _systematic(_sorted_inclusion(ordered, k, first), k)
    kept, by_index = order[picked].sort()
    return kept, scale[by_index]


def _sample_sorted_cpu(weights: torch.Tensor, k: int, winners: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sample_sorted` on a CPU tensor, computed in NumPy.

    The same probabilities and the same draw (the random order and offset come from torch's generator, so seeds,
    forked generators and ranks drawing alike behave as on the torch path); NumPy because a selection is ~35 ops
    on a few thousand numbers, where torch's per-op dispatch (~4–6 µs from Python) is the whole cost: 50–140 µs
    per selection against 200–310 µs, in every backward-sampled layer of every step."""
    w = weights.detach().numpy()
    n = w.size
    order = np.argsort(-w, kind="stable")
    ordered = w[order].astype(np.float64)
    tail = np.cumsum(ordered[::-1])[::-1][: k + 1]                       # Σ_{j≥m} w_j for m = 0..k
    clamped = np.arange(k + 1)
    fits = ((k - clamped) * ordered[: k + 1] <= (1.0 + 1e-6) * tail) | (tail <= 0)
    if winners:   # wta_crs_split: argmin over c < k of (1 − Σ_{top c} p) / (k − c), with 1 − Σ_{top c} p = T_c / T_0
        fits &= clamped >= int(np.argmin(tail[:k] / np.arange(k, 0, -1)))
    m = int(np.argmax(fits))
    probabilities = np.minimum((k - m) / tail[m] * ordered, 1.0) if tail[m] > 0 else np.zeros(n)
    probabilities[:m] = 1.0
    shuffle = torch.randperm(n).numpy()
    offset = torch.rand((), dtype=torch.float64).item()
    ends = np.cumsum(probabilities[shuffle])
    points = offset + np.arange(k)
    picked = shuffle[np.minimum(np.searchsorted(ends, points, side="right"), n - 1)]
    scale = np.where(points < ends[-1], 1.0 / np.maximum(probabilities[picked], np.finfo(np.float32).tiny), 0.0)
    kept = order[picked]
    by_index = np.argsort(kept, kind="stable")
    return torch.from_numpy(kept[by_index]), torch.from_numpy(scale[by_index].astype(np.float32))


@register_method("crs")
def select_crs(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """CRS: ``k`` distinct pairs by systematic PPS sampling with inclusion probabilities ``π_i = min(1, c·p_i)``,
    ``p_i ∝ w_i`` mixed with a uniform floor (:func:`crs_probabilities`), ``Σ π = k``; pair ``i`` scaled by
    ``1 / π_i``. Unbiased; a fixed number of pairs (the sampled GEMM's shapes never depend on the draw), and less
    variance than ``k`` (or more) i.i.d. draws with replacement: a pair is never drawn twice.
    """
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device), torch.ones(n, dtype=torch.float32, device=scores.device)
    return _sample_sorted(crs_probabilities(scores.float()), k)


@register_method("bernoulli")
def select_bernoulli(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bernoulli-CRS: keep pair ``i`` independently with ``p_i`` (expected count ``k``), scaled by ``1/p_i``.

    The one method whose number of kept pairs depends on the draw: its sampled op's shapes change every step
    (a host synchronisation on a GPU, a recompilation or graph break under ``torch.compile``). ``method="auto"``
    never picks it."""
    probabilities = bernoulli_probabilities(scores, k)
    kept = torch.nonzero(torch.rand_like(probabilities) < probabilities).flatten()
    return kept, 1.0 / probabilities[kept]


def wta_crs_split(probabilities: torch.Tensor, k: int) -> torch.Tensor:
    """How many of the ``k`` slots WTA-CRS fills deterministically: the ``c`` in ``[0, k)`` minimising
    ``(1 − Σ_{top c} p) / (k − c)`` (Liu et al.'s variance bound; ``probabilities`` sorted descending); a 0-d
    tensor (no host synchronisation)."""
    head = torch.cumsum(probabilities[: k - 1], 0) if k > 1 else probabilities.new_zeros(0)
    mass_before = torch.cat([probabilities.new_zeros(1), head])           # Σ_{top c} p for c = 0..k−1
    remaining_slots = torch.arange(k, 0, -1, device=probabilities.device, dtype=probabilities.dtype)
    return torch.argmin((1.0 - mass_before).clamp_min(0) / remaining_slots)


@register_method("wta_crs")
def select_wta_crs(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Winner-take-all CRS (Liu et al., NeurIPS 2023): the ``c`` most probable pairs kept as they are, the
    other ``k − c`` slots filled from the remaining distribution, scaled — unbiased, and far less variance than
    plain CRS when a few pairs carry most of the mass.

    ``p_i ∝ w_i`` (uniform when every ``w`` is 0); ``c`` minimises Liu et al.'s bound (:func:`wta_crs_split`).
    The winners get inclusion probability 1 (scale 1); the others ``π_i = min(1, c'·p_i)`` with ``Σ = k − c``,
    and the ``k`` pairs are drawn together by systematic PPS sampling (:func:`systematic_sample`): ``k − c``
    distinct pairs besides the winners, never a duplicate, where the paper's ``k − c`` i.i.d. draws repeat some.
    A fixed number of pairs and no host synchronisation. ``random_share`` is ignored (every pair with
    ``w_i > 0`` can be drawn; one with ``w_i = 0`` contributes nothing).
    """
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device), torch.ones(n, dtype=torch.float32, device=scores.device)
    weights = scores.float()
    weights = torch.where(weights.sum() > 0, weights, torch.ones_like(weights))   # all zero: uniform
    # The winners are the first c of the sorted weights; p need not be normalised for the split (the bound's
    # argmin is the same for w / Σw), and the others' probabilities are _sorted_inclusion's with at least c sure.
    return _sample_sorted(weights, k, winners=True)


@register_method("pps")
def select_pps(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPS sampling (VCAS's "soft top-k", Xi et al., ICLR 2024): ``k`` distinct pairs, pair ``i`` kept with
    ``π_i = min(1, c·w_i)``, ``Σ π = k`` (the largest kept surely, the rest in proportion to their weight),
    scaled by ``1 / π_i``. For a fixed number of kept pairs these are the probabilities that minimise the
    Horvitz–Thompson estimate's variance ``Σ (1/π_i − 1)·‖A_i‖²‖B_i‖²`` when the scores are ``‖A_i‖·‖B_i‖`` —
    no uniform floor (CRS) and no winners chosen by a with-replacement bound (WTA-CRS). Pairs with ``w_i = 0``
    are never drawn (they contribute nothing) unless fewer than ``k`` carry weight, when the spare slots get
    scale 0. Unbiased; a fixed number of pairs; no host synchronisation off the CPU. ``random_share`` is
    ignored."""
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device), torch.ones(n, dtype=torch.float32, device=scores.device)
    weights = scores.float()
    weights = torch.where(weights.sum() > 0, weights, torch.ones_like(weights))   # all zero: uniform
    return _sample_sorted(weights, k)


def select_pairs(method: str, scores: torch.Tensor, k: int,
                 random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select ``k`` of the ``scores.numel()`` pairs with the registered ``method``."""
    try:
        selector = METHODS[method]
    except KeyError:
        allowed = ", ".join(repr(m) for m in sorted(METHODS))
        raise ValueError(f"method must be one of {allowed}, got {method!r}") from None
    if not torch.compiler.is_compiling():
        # under torch.compile a share that differs between layers is a symbolic float, which math.isnan cannot
        # take; the plan's SamplingSpec checked it already
        random_share = check_share("random_share", random_share)
    if current().isolate_draws:
        # A guarded step (fxapprox.runtime.guard): draw from a fork of the RNG, so that the layers' dropout draws the
        # same masks as in the exact reference pass, which replays the step from the same RNG state.
        devices = [scores.device] if scores.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return selector(scores, k, random_share)
    return selector(scores, k, random_share)
