"""Pass 4a — candidates: which layers can be approximated, and how.

A pure graph pass over analysed nodes (FLOPs, shapes and channels known). For
every node that does FLOPs or is of a recognised layer kind it writes a
:class:`~fxapprox.pipeline.records.LayerCandidates` under ``node.meta[CANDIDATES_KEY]``:

* ``blocker`` — why the node stays exact whatever the budget (no approximate
  version of the op, grouped conv, fewer than ``min_channels`` pairs, shared
  module, excluded by an override, …), or ``None``;
* ``allowed_methods`` / ``allowed_modes`` — what the candidates may use (the
  ``method=`` argument, the config's ``mode``, a matching override, and what the
  op kind offers);
* ``pinned_ratio`` — a keep-ratio fixed by an override;
* ``candidates`` — for the measured policy: one frozen
  :class:`~fxapprox.pipeline.records.Candidate` per (method, mode, keep-ratio) on
  ``config.keep_ratios`` with its planned training FLOPs, or the reason it does
  not fit this node (``blocked``). The measurement pass (``measure_candidates``)
  writes them again with their measured errors and speed.

The kind-specific parts (blockers, offered modes, FLOPs of a candidate) come from
the op-kind registry (``fxapprox/op_kinds/registry.py``).
"""

from __future__ import annotations

from collections import Counter

import torch.fx

from fxapprox.config import AUTO_METHODS, ApproxConfig
from fxapprox.op_kinds.registry import handler_for, kept_count
from fxapprox.passes.analysis.graph_view import target_name
from fxapprox.passes.capture.torch_transformer import kept_whole_reason
from fxapprox.passes.capture.training_flags import ModeFollowingCall
from fxapprox.pipeline.records import CANDIDATES_KEY, EAGER_REASON_KEY, Candidate, LayerCandidates, kind_of, train_flops

__all__ = ["enumerate_candidates", "layer_names", "parameterised", "planned_layers"]


def parameterised(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` owns trainable parameters: a module with its own, or a parameter ``get_attr``."""
    if node.op == "call_module":
        return any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part, None)
        return isinstance(value, torch.nn.Parameter) and value.requires_grad
    return False


def layer_names(node: torch.fx.Node) -> tuple[str, ...]:
    """The names an override may use for ``node``: node name, target, module scope + node name."""
    names = [node.name]
    if isinstance(node.target, str):
        names.append(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        scope = list(stack.values())[-1][0]
        if scope:
            names.append(f"{scope}.{node.name}")
    return tuple(dict.fromkeys(names))


def planned_layers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes a plan lists: every compute node that does FLOPs or is of a recognised layer kind."""
    return [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")
            and (train_flops(n) > 0 or kind_of(n).op_kind is not None)]


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _blocker(gm: torch.fx.GraphModule, node: torch.fx.Node, config: ApproxConfig, calls: Counter) -> str | None:
    """Why ``node`` cannot be approximated at all, or ``None`` when it can."""
    handler = handler_for(node)
    kind = kind_of(node)
    if node.meta.get(EAGER_REASON_KEY):
        return f"runs eagerly, exact ({node.meta[EAGER_REASON_KEY]})"
    if handler is None:
        if kind.unsupported is not None:
            return kind.unsupported
        module = _module(gm, node)
        if isinstance(module, ModeFollowingCall):   # a traced function whose flag follows the mode
            return f"{getattr(module.function, '__qualname__', module.function)}: no sampled version of this op"
        if node.op == "call_module":
            whole = kept_whole_reason(module)   # torch's transformer modules: why this one stays whole
            return whole or f"opaque leaf module ({kind.module_type}): its inside is not traced"
        return f"{target_name(node)}: no sampled version of this op"
    reason = handler.blocker(gm, node)
    if reason is not None:
        return reason
    if node.op == "call_module" and calls[node.target] > 1:
        return f"module called at {calls[node.target]} places: a shared module stays exact"
    n = kind.reduction_size or 0
    if n < config.min_channels:
        return f"reduces over {n} channels < min_channels={config.min_channels}"
    if train_flops(node) == 0:
        return "no FLOPs measured (not executed on the example inputs)"
    return None


def enumerate_candidates(gm: torch.fx.GraphModule, method: str, config: ApproxConfig) -> torch.fx.GraphModule:
    """Write each planned layer's :class:`~fxapprox.pipeline.records.LayerCandidates`.

    Example::

        >>> enumerate_candidates(gm, "topk", ApproxConfig())
        >>> [c.mode for c in candidates_of(gm.graph.find_nodes(op="call_module", target="fc")[0]).candidates]
        ['forward', 'forward', 'forward', 'backward', ...]
    """
    nodes = list(gm.graph.nodes)
    calls = Counter(n.target for n in nodes if n.op == "call_module")
    for node in planned_layers(gm):
        blocker = _blocker(gm, node, config, calls)
        override = config.override_for(layer_names(node), _module(gm, node))
        if blocker is None and override is not None and override.exclude:
            blocker = f"excluded by override {override.describe()}"
        if blocker is not None:
            node.meta[CANDIDATES_KEY] = LayerCandidates(blocker=blocker)
            continue
        handler = handler_for(node)
        chosen_method = override.method if override is not None and override.method else method
        mode = override.mode if override is not None and override.mode else config.mode
        modes = [m for m in ((mode,) if mode is not None else config.candidate_modes) if m in handler.modes]
        if not modes:
            modes = list(handler.modes)   # e.g. an LSTM under mode="forward": its only mode is backward

        def methods_for(mode_name: str) -> list[str]:
            methods = list(AUTO_METHODS[mode_name]) if chosen_method == "auto" else [chosen_method]
            if handler.methods is not None:
                methods = [m for m in methods if m in handler.methods] or list(handler.methods)
            return methods
        pinned = override is not None and override.keep_ratio is not None
        n = kind_of(node).reduction_size
        ratios = (override.keep_ratio,) if pinned else config.keep_ratios
        candidates = []
        for mode_name in modes:
            for candidate_method in methods_for(mode_name):
                for ratio in ratios:
                    k = kept_count(ratio, n)
                    if k >= n:
                        continue
                    keep = k / n
                    candidates.append(Candidate(
                        method=candidate_method, mode=mode_name, keep_ratio=keep, k=k, n=n,
                        flops=handler.candidate_flops(node, mode_name, keep),
                        blocked=handler.mode_blocker(node, mode_name, keep, config.min_k, config.min_channels)))
        node.meta[CANDIDATES_KEY] = LayerCandidates(
            allowed_methods=tuple(sorted({m for mode_name in modes for m in methods_for(mode_name)})),
            allowed_modes=tuple(modes), requested_method=chosen_method,
            pinned_ratio=override.keep_ratio if pinned else None, pinned_by=override.describe() if pinned else None,
            candidates=tuple(candidates))
    return gm
