"""Pass 6e — rewrite for compressed saving: mark each planned value with a ``compress_saved`` node.

After the last node that defines (or aliases) a planned value, insert
``fxapprox.runtime.saved_markers.compress_saved(value, bits, sign_exact)``. The node
has no users and no effect outside a compressing training forward; inside one it
tags the value's storage, so whatever autograd saves from it is kept as a
``bits``-bit copy (see :mod:`fxapprox.runtime.saved_activations`). The forward's values
are untouched, so the forward stays exact.

A value the plan recomputes gets ``recompute_saved(value, source, recipe, args,
kwargs)`` instead, with the op's own arguments (its module through a ``get_attr``
node): backward re-runs the op on the source's saved copy.
"""

from __future__ import annotations

import torch.fx

from fxapprox.passes.memory.memory_widths import recipe_of
from fxapprox.passes.memory.rewrite_checkpoint import forward_of
from fxapprox.plan import MemoryPlan
from fxapprox.runtime.saved_markers import compress_saved, recompute_saved


def rewrite_saved_activations(gm: torch.fx.GraphModule, memory_plan: MemoryPlan) -> torch.fx.GraphModule:
    """Insert the ``compress_saved`` markers ``memory_plan`` asks for; returns ``gm`` (recompiled).

    Example::

        >>> gm = rewrite_saved_activations(gm, memory_plan)
        >>> [n.args[1] for n in gm.graph.nodes if n.target is compress_saved][:2]
        [4, 4]
    """
    by_name = {node.name: node for node in gm.graph.nodes}
    for decision in memory_plan.compressed:
        members = [by_name[name] for name in (decision.node, *decision.aliases)]
        # after the last view or in-place write; the same tensor received by several regions of a stitched graph
        # is marked in each (each may be the first to save it)
        for last in members if all(m.op == "placeholder" for m in members) else members[-1:]:
            with gm.graph.inserting_after(last):
                gm.graph.call_function(compress_saved, (last, decision.bits, decision.sign_exact))
    for decision in memory_plan.recomputed:
        node, last = by_name[decision.node], by_name[(decision.aliases or [decision.node])[-1]]
        recipe, source = recipe_of(gm, node, linear=True)   # the plan only lists what its config allowed
        with gm.graph.inserting_after(last):
            if recipe == "module":
                recipe = gm.graph.get_attr(node.target)
            with gm.graph.inserting_after(recipe if isinstance(recipe, torch.fx.Node) else last):
                gm.graph.call_function(recompute_saved, (node, source, recipe, tuple(node.args), dict(node.kwargs)))
    gm.graph.lint()
    gm.recompile()
    return gm


def remove_saved_markers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Undo :func:`rewrite_saved_activations`: erase every marker node (and the ``get_attr`` nodes only they used);
    returns ``gm`` (recompiled). A memory re-plan marks the graph again from scratch."""
    markers = [n for n in gm.graph.nodes if n.target in (compress_saved, recompute_saved)]
    modules = {arg for n in markers if n.target is recompute_saved for arg in n.args[2:3]
               if isinstance(arg, torch.fx.Node)}
    for node in markers:
        gm.graph.erase_node(node)
    for node in modules:
        if not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def unmarked_forward(gm: torch.fx.GraphModule):
    """The ``forward(self, *args, **kwargs)`` of a copy of ``gm``'s graph without the marker nodes (call it with
    ``gm``): the training forward under ``torch.compile``, where the compiled graphs' own hooks compress what
    is saved (:mod:`fxapprox.runtime.compiled_saving`) and the markers would only be traced for nothing."""
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node.target in (compress_saved, recompute_saved):
            continue
        if node.op == "get_attr" and node.users and all(u.target is recompute_saved for u in node.users):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    return forward_of(graph, "<fxapprox: compiled training forward>")
