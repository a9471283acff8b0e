"""Pass 4 — budget policy: turn ``budget`` into an explicit, serialisable plan.

``budget`` is the fraction of the exact model's training-step FLOPs (forward +
backward, as measured by the flops pass) the approximated model may spend.
Sampling a layer at keep-ratio ``k/n`` multiplies its *sampled* FLOPs by
``k/n``: all of its training FLOPs in forward mode (the three GEMMs shrink),
its backward FLOPs in backward mode (the forward stays exact).

The policy:

1. decides which layers *can* be sampled, writing the reason for every layer
   that cannot (no sampled op for it, grouped conv, fewer than
   ``min_channels`` pairs, excluded by an override, ...);
2. applies overrides that pin a keep-ratio;
3. walks the ranking (biggest, widest layers first) sampling each layer at the
   preferred ``keep_ratio`` until the budget is met, raising the last layer's
   ratio so that no more is cut than needed; the layers it did not need stay
   exact ("not needed");
4. if even every eligible layer at ``keep_ratio`` is not enough, lowers one
   common ratio for all of them, never below ``min_keep_ratio``; if the budget
   is still out of reach, the plan says what was achieved and why.

With ``policy="uniform"`` steps 3–4 are replaced by the papers' recipe: every
eligible layer at ``keep_ratio``; the budget is then only reported against.
"""

from __future__ import annotations

import math
from collections import Counter

import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.modules import lstm_blocker, resolve_conv_padding
from fxapprox.plan import LayerDecision, Plan
from fxapprox.passes._meta import fx_meta, train_flops
from fxapprox.passes.graph_view import target_name
from fxapprox.passes.rank import SAMPLEABLE_KINDS

_TOLERANCE = 1e-9


def _names(node: torch.fx.Node) -> tuple[str, ...]:
    names = [node.name]
    if isinstance(node.target, str):
        names.append(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        scope = list(stack.values())[-1][0]
        if scope:
            names.append(f"{scope}.{node.name}")
    return tuple(dict.fromkeys(names))


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _blocker(node: torch.fx.Node, meta: dict, config: ApproxConfig, calls: Counter) -> str | None:
    """Why ``node`` cannot be sampled, or ``None`` when it can."""
    kind = meta.get("op_kind")
    if kind in ("gru", "rnn"):
        return f"recurrent layer ({meta.get('module_type')}): no sparse-backward version yet"
    if kind is None:
        if node.op == "call_module":
            return f"opaque leaf module ({meta.get('module_type')}): its inside is not traced"
        return f"{target_name(node)}: no sampled version of this op"
    if kind not in SAMPLEABLE_KINDS:
        return f"{meta.get('module_type', kind)}: only Linear, Conv2d, LSTM, linear, conv2d and matmul are sampled"
    if kind in ("linear_fn", "conv2d_fn", "matmul") and not meta.get("parameter_operand"):
        return "no parameter operand (both operands are activations)"
    if kind == "conv2d_fn" and not meta.get("numeric_padding", True):
        return "functional conv2d with string or traced padding: not sampled"
    if kind in ("conv2d", "conv2d_fn"):
        groups = meta.get("groups", 1)
        if groups == meta.get("in_channels") and groups > 1:
            return "depthwise conv (groups == in_channels): one channel per group, nothing to sample"
        if groups is None:
            return "functional conv2d with traced groups: not sampled"
        if groups != 1:
            return f"grouped conv (groups={groups}): channel sampling per group not supported"
    if node.op == "call_module" and calls[node.target] > 1:
        return f"module called at {calls[node.target]} places: a shared module stays exact"
    n = meta.get("reduction_size") or 0
    if n < config.min_channels:
        return f"reduces over {n} channels < min_channels={config.min_channels}"
    if train_flops(node) == 0:
        return "no FLOPs measured (not executed on the example inputs)"
    return None


def _k_at(ratio: float, n: int) -> int:
    return max(1, min(n, math.floor(ratio * n + _TOLERANCE)))


def plan_budget(gm: torch.fx.GraphModule, budget: float, method: str,
                config: ApproxConfig | None = None) -> Plan:
    """Make the plan for ``gm`` (analysed and ranked) under ``budget``.

    Writes each layer's decision to ``node.meta["fxapprox"]["plan"]`` and returns the :class:`Plan`.

    Example::

        >>> plan = plan_budget(gm, 0.5, "topk")
        >>> plan.budget_met, round(plan.achieved, 2)
        (True, 0.5)
    """
    config = config or ApproxConfig()
    nodes = list(gm.graph.nodes)
    total = sum(train_flops(n) for n in nodes)
    target = budget * total
    calls = Counter(n.target for n in nodes if n.op == "call_module")
    layers = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")
              and (train_flops(n) > 0 or fx_meta(n).get("op_kind") is not None)]

    reasons: dict[torch.fx.Node, str] = {}
    chosen_k: dict[torch.fx.Node, int] = {}
    methods: dict[torch.fx.Node, str] = {}
    modes: dict[torch.fx.Node, str] = {}
    pinned: set[torch.fx.Node] = set()
    candidates: list[torch.fx.Node] = []

    for node in layers:
        meta = fx_meta(node)
        blocker = _blocker(node, meta, config, calls)
        if blocker is None and meta.get("op_kind") == "conv2d" and resolve_conv_padding(_module(gm, node)) is None:
            blocker = "asymmetric 'same' padding (even kernel): not sampled"
        if blocker is None and meta.get("op_kind") == "lstm":
            blocker = lstm_blocker(_module(gm, node))
        override = config.override_for(_names(node), _module(gm, node))
        if blocker is None and override is not None and override.exclude:
            blocker = f"excluded by override {override.describe()}"
        if blocker is not None:
            reasons[node] = blocker
            continue
        methods[node] = (override.method if override and override.method else method)
        modes[node] = (override.mode if override and override.mode else config.mode)
        if meta.get("op_kind") == "lstm":
            # An LSTM keeps its forward exact and the top-k gate-gradient columns in backward.
            methods[node], modes[node] = "topk", "backward"
        n = meta["reduction_size"]
        if override is not None and override.keep_ratio is not None:
            k = _k_at(override.keep_ratio, n)
            if k < n:
                chosen_k[node] = k
                reasons[node] = f"keep-ratio pinned by override {override.describe()}"
            else:
                reasons[node] = f"keep-ratio 1.0 pinned by override {override.describe()}"
            pinned.add(node)
            continue
        candidates.append(node)

    candidates.sort(key=lambda n: fx_meta(n).get("rank", math.inf))

    def sampled_flops(node: torch.fx.Node) -> int:
        return train_flops(node) if modes[node] == "forward" else int(fx_meta(node).get("flops_bwd", 0))

    def saving(node: torch.fx.Node, k: int) -> float:
        return (1.0 - k / fx_meta(node)["reduction_size"]) * sampled_flops(node)

    needed = total - target
    saved = sum(saving(n, k) for n, k in chosen_k.items())
    walked: list[torch.fx.Node] = []
    if budget >= 1.0:
        for node in candidates:
            reasons[node] = "budget 1.0: exact training requested"
    elif config.policy == "uniform":
        for node in candidates:
            n = fx_meta(node)["reduction_size"]
            k = _k_at(config.keep_ratio, n)
            if k < config.min_k:
                reasons[node] = f"k={k} at keep-ratio {config.keep_ratio:g} < min_k={config.min_k}"
            elif k >= n:
                reasons[node] = f"keep-ratio {config.keep_ratio:g} keeps all {n} pairs"
            else:
                chosen_k[node] = k
                reasons[node] = f"uniform recipe: keep-ratio {config.keep_ratio:g} for >= {config.min_channels} channels"
    else:
        # Phase 3 of the docstring: rank order at the preferred keep-ratio.
        for node in candidates:
            n = fx_meta(node)["reduction_size"]
            k = _k_at(config.keep_ratio, n)
            if saved >= needed - _TOLERANCE:
                reasons[node] = "not needed: higher-ranked layers already meet the budget"
                continue
            if k < config.min_k:
                reasons[node] = f"k={k} at keep-ratio {config.keep_ratio:g} < min_k={config.min_k}"
                continue
            if k >= n:
                reasons[node] = f"keep-ratio {config.keep_ratio:g} keeps all {n} pairs"
                continue
            walked.append(node)
            chosen_k[node] = k
            saved += saving(node, k)
            reasons[node] = f"rank {fx_meta(node)['rank']}: sampled at the preferred keep-ratio"
        if walked and saved > needed + _TOLERANCE:
            last = walked[-1]
            n = fx_meta(last)["reduction_size"]
            before = saved - saving(last, chosen_k[last])
            ratio = 1.0 - (needed - before) / sampled_flops(last)
            chosen_k[last] = max(chosen_k[last], _k_at(ratio, n))
            saved = before + saving(last, chosen_k[last])
            reasons[last] = (f"rank {fx_meta(last)['rank']}: keep-ratio raised to cut no more than the budget needs"
                             if chosen_k[last] < n else "not needed: higher-ranked layers already meet the budget")
        elif walked and saved < needed - _TOLERANCE:
            # Phase 4: one common, lower ratio for every walked layer.
            fixed = sum(saving(n, chosen_k[n]) for n in pinned if n in chosen_k)
            walked_flops = sum(sampled_flops(n) for n in walked)
            ratio = max(config.min_keep_ratio, 1.0 - (needed - fixed) / walked_flops)
            while True:
                for node in walked:
                    n = fx_meta(node)["reduction_size"]
                    k = max(_k_at(ratio, n), math.ceil(config.min_keep_ratio * n - _TOLERANCE), config.min_k)
                    chosen_k[node] = min(k, n)
                saved = fixed + sum(saving(n, chosen_k[n]) for n in walked)
                if saved >= needed - _TOLERANCE or ratio <= config.min_keep_ratio:
                    break
                ratio = max(config.min_keep_ratio, ratio - 0.005)
            for node in walked:
                reasons[node] = f"rank {fx_meta(node)['rank']}: common keep-ratio lowered to {ratio:.3f} to meet the budget"

    decisions = []
    planned_total = total
    for node in layers:
        meta = fx_meta(node)
        exact = train_flops(node)
        k = chosen_k.get(node)
        n = meta.get("reduction_size")
        approximate = k is not None and k < n
        planned = exact
        if approximate:
            planned = round(exact - (1.0 - k / n) * sampled_flops(node))
        planned_total -= exact - planned
        decision = LayerDecision(
            node=node.name, target=target_name(node), op_kind=meta.get("op_kind"), shape=meta.get("shape"),
            in_channels=meta.get("in_channels"), out_channels=meta.get("out_channels"), exact_flops=exact,
            planned_flops=planned, approximate=approximate, reason=reasons[node],
            method=methods.get(node) if approximate else None, mode=modes.get(node) if approximate else None,
            k=k if approximate else None, n=n if approximate else None,
            random_share=config.random_share if approximate and methods[node] == "topk"
            and meta.get("op_kind") != "lstm" else 0.0,
            rank=meta.get("rank"), saved_bytes=int(meta.get("saved_bytes", 0)))
        meta["plan"] = decision.to_dict()
        decisions.append(decision)

    budget_met = planned_total <= target + 0.5 or budget >= 1.0
    note = _note(budget, total, planned_total, budget_met, decisions, config)
    return Plan(budget=budget, method=method, total_exact_flops=int(total),
                total_planned_flops=int(planned_total), budget_met=budget_met, note=note,
                layers=tuple(decisions), config=config.to_dict())


def _note(budget, total, planned, met, decisions, config) -> str:
    achieved = planned / total if total else 1.0
    if total == 0:
        return "the model does no measured FLOPs: nothing to approximate"
    if budget >= 1.0:
        return "budget 1.0: the plan is exact"
    sampled = sum(d.approximate for d in decisions)
    if config.policy == "uniform":
        return (f"uniform recipe (keep-ratio {config.keep_ratio:g} for layers with >= {config.min_channels} "
                f"channels): {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs; "
                f"budget {budget:g} {'met' if met else 'not met'}")
    if met:
        return f"budget {budget:g} met: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs"
    exact_share = sum(d.exact_flops for d in decisions if not d.approximate) / total
    blockers = Counter(d.reason.split(":")[0] for d in decisions if not d.approximate)
    top = "; ".join(f"{reason} ({count})" for reason, count in blockers.most_common(3))
    return (f"budget {budget:g} not reachable: achieved {achieved:.3f}. {exact_share:.0%} of training FLOPs "
            f"are in layers that stay exact ({top or 'none'}), and sampled layers stop at "
            f"min_keep_ratio={config.min_keep_ratio:g}")
