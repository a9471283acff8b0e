"""Pass 4d — input saving: what each forward-sampled layer keeps of its input for backward.

A forward-sampled layer needs only its input's kept columns (channels) in backward. It can keep the input
itself (``"reference"``) and gather them again, or keep a gathered copy (``"gathered"``, ``k/n`` of the
input). Which costs less memory depends on the rest of the graph, which the saved-bytes analysis
(``saved_from``: the graph values each node saves) already knows:

* another node saves the same tensor anyway (the ReLU before a convolution saves its result; a residual
  branch's other layer saves it too): a reference costs nothing, a copy is ``k/n`` on top → ``"reference"``;
* only sampled layers save it and their copies add up to less than the tensor (``Σ k/n < 1``): the copies
  replace it and memory falls → ``"gathered"`` (the input of a transformer's second feed-forward Linear, a
  GELU's output that nothing else saves, is the widest activation of the block);
* otherwise → ``"reference"``: never more than the exact layer saves.

Views and in-place results count as the tensor they share memory with (``alias_of``). The choice goes into
each decision's ``save_input`` and, through the rewrite, the layer's :class:`fxapprox.runtime.modules.SamplingSpec`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch.fx

from fxapprox.pipeline.records import saved_of
from fxapprox.plan import Plan


def _root(by_name: dict[str, torch.fx.Node], name: str) -> str:
    """The value whose memory ``name`` shares, following views and in-place ops."""
    seen = set()
    while name not in seen:
        seen.add(name)
        alias = saved_of(by_name[name]).alias_of if name in by_name else None
        if alias is None:
            return name
        name = alias
    return name


def _choice(node: torch.fx.Node, by_name: dict, savers: dict, sampled: dict) -> tuple[str, str]:
    """``(save_input, why)`` for the forward-sampled ``node``, from who saves its activation input."""
    activations = [arg for arg in node.all_input_nodes if arg.op != "get_attr"]
    if len(activations) != 1:
        return "reference", f"{len(activations)} activation operands"
    root = _root(by_name, activations[0].name)
    if node.name not in savers[root]:
        return "reference", f"input {root} is not saved as a graph value"
    others = savers[root] - set(sampled)
    if others:
        return "reference", f"input {root} is saved anyway by {', '.join(sorted(others))}"
    share = sum(sampled[s].k / sampled[s].n for s in savers[root])
    if share < 1.0:
        return "gathered", f"only sampled layers save input {root}: their kept columns are {share:.2f} of it"
    return "reference", f"the sampled layers saving input {root} keep {share:.2f} of it in all"


def plan_input_saving(gm: torch.fx.GraphModule, plan: Plan) -> Plan:
    """Set ``save_input`` on every forward-sampled decision of ``plan`` from ``gm``'s saved-bytes analysis.

    Example::

        >>> plan = plan_input_saving(gm, plan_budget(gm, 0.5))
        >>> plan.decision("fc2").save_input
        'gathered'
    """
    by_name = {node.name: node for node in gm.graph.nodes}
    sampled = {d.node: d for d in plan.approximated if d.mode == "forward"}
    savers: dict[str, set[str]] = defaultdict(set)        # root value → nodes that save it
    for node in gm.graph.nodes:
        for source in saved_of(node).saved_from:
            savers[_root(by_name, source)].add(node.name)
    choices = {name: _choice(by_name[name], by_name, savers, sampled) for name in sampled}
    layers = tuple(dataclasses.replace(d, save_input=choices[d.node][0], save_input_reason=choices[d.node][1])
                   if d.node in choices else d for d in plan.layers)
    return dataclasses.replace(plan, layers=layers)


__all__ = ["plan_input_saving"]
