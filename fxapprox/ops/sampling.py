"""Column-row pair selection: the part of CRS that decides *which* pairs to keep.

A selector takes the importance score of every pair (``‖A[:, i]‖·‖B[i, :]‖``,
shape ``(n,)``) and the number ``k`` of pairs to keep, and returns the kept
indices (sorted ascending, so the gathers that follow walk memory in order)
and, for unbiased estimators, a per-kept-pair scale (``None`` when no scaling
is applied). Selectors are registered by name; ``method=`` on
:func:`fxapprox.approximate` picks one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Selector = Callable[[torch.Tensor, int], "tuple[torch.Tensor, torch.Tensor | None]"]

METHODS: dict[str, Selector] = {}


def register_method(name: str) -> Callable[[Selector], Selector]:
    """Register a pair selector under ``name`` (used by ``method=``)."""

    def decorator(selector: Selector) -> Selector:
        if name in METHODS:
            raise ValueError(f"sampling method {name!r} is already registered")
        METHODS[name] = selector
        return selector

    return decorator


@register_method("topk")
def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, None]:
    """top-k-CRS: keep the ``k`` pairs with the largest scores, unscaled (biased)."""
    k = min(k, scores.numel())
    kept = torch.topk(scores, k, sorted=False).indices
    return kept.sort().values, None


def select_pairs(method: str, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Select ``k`` of the ``scores.numel()`` pairs with the registered ``method``."""
    try:
        selector = METHODS[method]
    except KeyError:
        allowed = ", ".join(repr(m) for m in sorted(METHODS))
        raise ValueError(f"method must be one of {allowed}, got {method!r}") from None
    return selector(scores, k)
