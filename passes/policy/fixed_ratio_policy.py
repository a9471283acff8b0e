"""The fixed-ratio budget policies: ``"flops"`` (the FLOP-ranked walk at the preferred ``keep_ratio``, then one
common ratio lowered to ``min_keep_ratio``) and ``"uniform"`` (every eligible layer at ``keep_ratio``, the papers'
recipe). Each returns ``{node: Choice}`` for :func:`fxapprox.passes.policy.budget_policy.plan_budget`.
"""

from __future__ import annotations

import math

import torch.fx

from fxapprox.config import AUTO_METHODS, ApproxConfig
from fxapprox.op_kinds.registry import handler_for, kept_count
from fxapprox.passes.policy.policy_types import TOLERANCE, Choice
from fxapprox.pipeline.records import Candidate, LayerCandidates, candidates_of, kind_of, rank_of, train_flops

__all__ = ["flops_choices", "uniform_choices"]


def _single_mode(layer: LayerCandidates) -> str:
    """The one mode of the FLOP and uniform policies: the configured one (the candidates pass left only it),
    else forward sampling where the kind offers it."""
    modes = layer.allowed_modes or ("forward",)
    return "forward" if "forward" in modes else modes[0]


def _flops_candidate(node: torch.fx.Node, mode: str, method: str, k: int) -> Candidate:
    n = kind_of(node).reduction_size
    return Candidate(method=method, mode=mode, keep_ratio=k / n, k=k, n=n,
                     flops=handler_for(node).candidate_flops(node, mode, k / n))


def _fixed_ratio_layers(layers, config: ApproxConfig, method: str, choices: dict) -> tuple[list, dict]:
    """Layers the FLOP and uniform policies may sample (with mode and method), after blockers and pins."""
    free, settings = [], {}
    for node in layers:
        layer = candidates_of(node)
        if layer.blocker:
            choices[node] = Choice(None, layer.blocker)
            continue
        mode = _single_mode(layer)
        # One method per layer: "auto" is the mode's first auto method (top-k forward, WTA-CRS backward).
        chosen_method = layer.requested_method
        if chosen_method == "auto":
            chosen_method = AUTO_METHODS[mode][0]
        offered = handler_for(node).methods
        if offered is not None and chosen_method not in offered:
            chosen_method = offered[0]
        settings[node] = (mode, chosen_method)
        blocker = handler_for(node).mode_blocker(node, mode, layer.pinned_ratio or config.keep_ratio, 1,
                                                 config.min_channels)
        if blocker is not None:
            choices[node] = Choice(None, blocker)
            continue
        if layer.pinned_ratio is not None:
            n = kind_of(node).reduction_size
            k = kept_count(layer.pinned_ratio, n)
            if k < n:
                choices[node] = Choice(_flops_candidate(node, mode, chosen_method, k),
                                        f"keep-ratio pinned by override {layer.pinned_by}")
            else:
                choices[node] = Choice(None, f"keep-ratio 1.0 pinned by override {layer.pinned_by}")
            continue
        free.append(node)
    return free, settings


def uniform_choices(gm, layers, budget, total, target, config: ApproxConfig, summary) -> dict:
    choices: dict = {}
    free, settings = _fixed_ratio_layers(layers, config, summary.method, choices)
    for node in free:
        n = kind_of(node).reduction_size
        k = kept_count(config.keep_ratio, n)
        mode, method = settings[node]
        blocker = handler_for(node).mode_blocker(node, mode, k / n, config.min_k, config.min_channels)
        if budget >= 1.0:
            choices[node] = Choice(None, "budget 1.0: exact training requested")
        elif k >= n:
            choices[node] = Choice(None, f"keep-ratio {config.keep_ratio:g} keeps all {n} pairs")
        elif blocker is not None:
            choices[node] = Choice(None, blocker)
        else:
            choices[node] = Choice(_flops_candidate(node, mode, method, k),
                                    f"uniform recipe: keep-ratio {config.keep_ratio:g} for >= {config.min_channels} "
                                    "channels")
    return choices


def flops_choices(gm, layers, budget, total, target, config: ApproxConfig, summary) -> dict:
    choices: dict = {}
    free, settings = _fixed_ratio_layers(layers, config, summary.method, choices)
    free.sort(key=lambda n: rank_of(n).rank if rank_of(n) is not None else math.inf)
    chosen_k = {n: c.candidate.k for n, c in choices.items() if c.candidate is not None}

    def candidate(node, k):
        mode, method = settings.get(node) or (choices[node].candidate.mode, choices[node].candidate.method)
        return _flops_candidate(node, mode, method, k)

    def saving(node, k) -> float:
        return train_flops(node) - candidate(node, k).flops

    needed = total - target
    saved = sum(saving(n, k) for n, k in chosen_k.items())
    walked: list = []
    if budget >= 1.0:
        for node in free:
            choices[node] = Choice(None, "budget 1.0: exact training requested")
        return choices
    for node in free:
        n = kind_of(node).reduction_size
        k = kept_count(config.keep_ratio, n)
        if saved >= needed - TOLERANCE:
            choices[node] = Choice(None, "not needed: higher-ranked layers already meet the budget")
            continue
        blocker = handler_for(node).mode_blocker(node, settings[node][0], k / n, config.min_k, config.min_channels)
        if k >= n:
            choices[node] = Choice(None, f"keep-ratio {config.keep_ratio:g} keeps all {n} pairs")
            continue
        if blocker is not None:
            choices[node] = Choice(None, blocker)
            continue
        walked.append(node)
        chosen_k[node] = k
        saved += saving(node, k)
        choices[node] = Choice(None, f"rank {rank_of(node).rank}: sampled at the preferred keep-ratio")
    if walked and saved > needed + TOLERANCE:
        last = walked[-1]
        n = kind_of(last).reduction_size
        before = saved - saving(last, chosen_k[last])
        k = chosen_k[last]
        while k + 1 < n and before + saving(last, k + 1) >= needed - TOLERANCE:
            k += 1
        chosen_k[last] = k
        saved = before + saving(last, k)
        choices[last] = Choice(None, f"rank {rank_of(last).rank}: keep-ratio raised to {k / n:.3f} so no more is "
                                      "cut than the budget needs")
    elif walked and saved < needed - TOLERANCE:
        # Phase 4 of the walk: one common ratio for every walked layer, lowered step by step.
        ratio = config.keep_ratio
        fixed = saved - sum(saving(n, chosen_k[n]) for n in walked)
        while True:
            for node in walked:
                n = kind_of(node).reduction_size
                k = max(kept_count(ratio, n), math.ceil(config.min_keep_ratio * n - TOLERANCE), config.min_k)
                chosen_k[node] = min(k, n)
            saved = fixed + sum(saving(n, chosen_k[n]) for n in walked)
            if saved >= needed - TOLERANCE or ratio <= config.min_keep_ratio:
                break
            ratio = max(config.min_keep_ratio, ratio - 0.005)
        for node in walked:
            choices[node] = Choice(None, f"rank {rank_of(node).rank}: common keep-ratio lowered to {ratio:.3f} to "
                                          "meet the budget")
    for node in walked:
        n = kind_of(node).reduction_size
        if chosen_k[node] < n:
            choices[node].candidate = candidate(node, chosen_k[node])
    return choices
