"""Column-row pair selection: the part of CRS that decides *which* pairs to keep.

A selector takes the importance score of every pair (``w_i = ‖A[:, i]‖·‖B[i, :]‖``,
shape ``(n,)``), the number ``k`` of pairs to keep and the ``random_share`` of
``k`` to draw uniformly (top-k's guard against starving a column), and returns
the kept indices (sorted ascending, so the gathers that follow walk memory in
order) and, for the unbiased estimators, a per-kept-pair scale (``None`` when
no scaling is applied). Selectors are registered by name; ``method=`` on
:func:`fxapprox.approximate` picks one.

No selector synchronises with the host except through the size of its output
(``crs``, ``bernoulli`` and ``wta_crs`` keep a data-dependent number of distinct
pairs; ``wta_crs`` also reads its split point and remaining mass on the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxapprox._validate import check_share
from fxapprox.ops._derived import local

Selector = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]

METHODS: dict[str, Selector] = {}

#: weight of the uniform distribution mixed into CRS probabilities (the papers' code uses 0.1)
CRS_UNIFORM_MIX = 0.1


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
        others = torch.ones(n, dtype=torch.float32, device=scores.device)
        others[top] = 0.0
        top = torch.cat([top, torch.multinomial(others, explore, replacement=False)])
    return top.sort().values, None


def crs_probabilities(scores: torch.Tensor) -> torch.Tensor:
    """CRS sampling distribution: ``p ∝ w`` mixed with a uniform floor (uniform when all w = 0)."""
    n = scores.numel()
    total = scores.sum()
    proportional = torch.where(total > 0, scores / total.clamp_min(torch.finfo(scores.dtype).tiny),
                               torch.full_like(scores, 1.0 / n))
    return (1.0 - CRS_UNIFORM_MIX) * proportional + CRS_UNIFORM_MIX / n


#: draws are capped at this many times the pairs they choose from (expected distinct pairs ≥ 98% of them)
_MAX_DRAWS_PER_PAIR = 4


def draws_for_distinct(probabilities: torch.Tensor, k: int) -> int:
    """The number ``m`` of i.i.d. draws from ``probabilities`` whose expected count of distinct pairs,
    ``Σ 1 − (1 − p_i)^m``, is ``k`` (at least ``k``; capped at 4 draws per pair).

    Drawing only ``k`` times wastes part of the plan on duplicates (at ``k = n/2`` on even scores only 39% of
    the pairs come out distinct, not 50%): the GEMM would run on fewer pairs than planned with the variance
    of ``k`` draws. With ``m`` draws the planned FLOPs are spent, in expectation, and the variance falls as
    ``1/m``.
    """
    n = probabilities.numel()
    if k >= n:
        return _MAX_DRAWS_PER_PAIR * n
    missing = torch.log1p(-probabilities.double().clamp(max=1 - 1e-12))

    def distinct(m: int) -> float:
        return float((1.0 - torch.exp(m * missing)).sum())

    low, high = k, _MAX_DRAWS_PER_PAIR * n
    if distinct(high) <= k:
        return high
    while low < high:   # the expected distinct count grows with m: bisect for the smallest m reaching k
        middle = (low + high) // 2
        if distinct(middle) >= k:
            high = middle
        else:
            low = middle + 1
    return low


@register_method("crs")
def select_crs(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """CRS: ``m`` i.i.d. draws with ``p_i ∝ w_i`` (uniform-mixed), pair ``i`` scaled by ``c_i / (m p_i)``.

    ``c_i`` is how many times pair ``i`` was drawn, so duplicates are merged into one
    kept pair (the smaller GEMM never sees the same column twice); ``m`` is chosen so that
    ``k`` distinct pairs are kept in expectation (:func:`draws_for_distinct`). Unbiased.
    """
    probabilities = crs_probabilities(scores.float())
    draws = draws_for_distinct(probabilities, k)
    picked = torch.multinomial(probabilities, draws, replacement=True)
    kept, counts = torch.unique(picked, sorted=True, return_counts=True)
    return kept, counts.to(torch.float32) / (draws * probabilities[kept])


def bernoulli_probabilities(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``p_i = min(1, c·w_i)`` with ``c`` chosen so that ``Σ p_i = k`` (clamped mass redistributed).

    With the weights sorted descending, if the ``m`` largest are clamped to 1 the
    rest share ``k - m``: ``c = (k - m) / Σ_{j≥m} w_j``; the right ``m`` is the
    smallest for which the largest unclamped weight satisfies ``c·w_m ≤ 1``.
    """
    weights = scores.float()
    n = weights.numel()
    if k >= n:
        return torch.ones_like(weights)
    positive = int(torch.count_nonzero(weights))
    if positive <= k:  # every pair that contributes anything is kept surely
        return (weights > 0).to(weights.dtype) if positive else torch.full_like(weights, k / n)
    ordered, order = torch.sort(weights, descending=True)
    tail = ordered.flip(0).cumsum(0).flip(0)                   # Σ_{j≥m} w_j
    clamped = torch.arange(k + 1, device=weights.device, dtype=weights.dtype)
    scale = (k - clamped) / tail[: k + 1]
    fits = scale * ordered[: k + 1] <= 1.0 + 1e-6
    m = int(torch.argmax(fits.to(torch.int8)))                 # first m that fits
    probabilities = torch.clamp(scale[m] * weights, max=1.0)
    probabilities[order[:m]] = 1.0
    return probabilities


@register_method("bernoulli")
def select_bernoulli(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bernoulli-CRS: keep pair ``i`` independently with ``p_i`` (expected count ``k``), scaled by ``1/p_i``."""
    probabilities = bernoulli_probabilities(scores, k)
    kept = torch.nonzero(torch.rand_like(probabilities) < probabilities).flatten()
    return kept, 1.0 / probabilities[kept]


def wta_crs_split(probabilities: torch.Tensor, k: int) -> int:
    """How many of the ``k`` slots WTA-CRS fills deterministically: the ``c`` in ``[0, k)`` minimising
    ``(1 − Σ_{top c} p) / (k − c)`` (Liu et al.'s variance bound; ``probabilities`` sorted descending)."""
    head = torch.cumsum(probabilities[: k - 1], 0) if k > 1 else probabilities.new_zeros(0)
    mass_before = torch.cat([probabilities.new_zeros(1), head])           # Σ_{top c} p for c = 0..k−1
    remaining_slots = torch.arange(k, 0, -1, device=probabilities.device, dtype=probabilities.dtype)
    return int(torch.argmin((1.0 - mass_before).clamp_min(0) / remaining_slots))


@register_method("wta_crs")
def select_wta_crs(scores: torch.Tensor, k: int, random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Winner-take-all CRS (Liu et al., NeurIPS 2023): the ``c`` most probable pairs kept as they are, the
    other ``k − c`` slots filled by i.i.d. draws from the remaining distribution, scaled — unbiased, and far
    less variance than plain CRS when a few pairs carry most of the mass.

    ``p_i ∝ w_i`` (uniform when every ``w`` is 0); ``c`` minimises Liu et al.'s bound
    (:func:`wta_crs_split`). A drawn pair ``j`` is scaled by ``count_j · (1 − Σ_C p) / (p_j · m)``; winners
    by 1. Unlike the paper's ``m = k − c`` draws, ``m`` is chosen so that ``k − c`` distinct pairs are drawn
    in expectation (:func:`draws_for_distinct`): the plan's FLOPs are spent, not lost to duplicates.
    ``random_share`` is ignored (the draws reach every pair with ``w_i > 0``; one with ``w_i = 0``
    contributes nothing).
    """
    n = scores.numel()
    if k >= n:
        kept = torch.arange(n, device=scores.device)
        return kept, torch.ones(n, dtype=torch.float32, device=scores.device)
    weights = scores.float()
    total = weights.sum()
    probabilities = weights / total if total > 0 else torch.full_like(weights, 1.0 / n)
    ordered, order = torch.sort(probabilities, descending=True)
    winners = wta_crs_split(ordered, k)
    rest = order[winners:]
    rest_probabilities = probabilities[rest]
    rest_mass = float(rest_probabilities.sum())   # summed from the tail: exact even when it is tiny
    if rest_mass <= 0.0:
        kept = order[:winners].sort().values   # the winners carry all the mass: exact
        return kept, torch.ones(kept.numel(), dtype=torch.float32, device=scores.device)
    draws = draws_for_distinct(rest_probabilities / rest_mass, k - winners)
    picked = rest[torch.multinomial(rest_probabilities, draws, replacement=True)]
    sampled, counts = torch.unique(picked, sorted=False, return_counts=True)
    sampled_scale = counts.to(torch.float32) * rest_mass / (probabilities[sampled] * draws)
    kept = torch.cat([order[:winners], sampled])
    scale = torch.cat([torch.ones(winners, dtype=torch.float32, device=scores.device), sampled_scale])
    kept, position = kept.sort()
    return kept, scale[position]


def select_pairs(method: str, scores: torch.Tensor, k: int,
                 random_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select ``k`` of the ``scores.numel()`` pairs with the registered ``method``."""
    try:
        selector = METHODS[method]
    except KeyError:
        allowed = ", ".join(repr(m) for m in sorted(METHODS))
        raise ValueError(f"method must be one of {allowed}, got {method!r}") from None
    random_share = check_share("random_share", random_share)
    if getattr(local, "isolate_draws", None):
        # A guarded step (fxapprox.guard): draw from a fork of the RNG, so that the layers' dropout draws the
        # same masks as in the exact reference pass, which replays the step from the same RNG state.
        devices = [scores.device] if scores.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return selector(scores, k, random_share)
    return selector(scores, k, random_share)
