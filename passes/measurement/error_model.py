"""The error model: what a candidate is predicted to add to the model-gradient error.

**Predicted error.** A layer approximated in isolation changes its output by a
relative ``e_out``, its input gradient by ``e_in`` and its weight gradient by
``e_w`` (measured on the example batch; noise already discounted over
``noise_horizon`` steps, see ``measure_candidates``). The model-gradient error
is the root-mean-square, over the model's ``N`` parameterised nodes, of each
one's relative gradient error, and errors of different layers add in squares:

* **backward and weight-gradient sampling** bias or blur the gradient of the
  exact model: ``e_w`` lands in the layer's own gradient; the input-gradient
  error ``e_in·‖dX‖`` reaches the parameterised nodes first met upstream, as a
  relative error of ``e_in·‖dX‖ / ‖dY_a‖`` each (capped at ``e_in``). The
  candidate adds ``(e_w² + W_in·e_in²) / N`` with
  ``W_in = Σ_a min(1, (‖dX‖ / ‖dY_a‖)²)`` (in a stitched planning graph a region's
  input fed by eager code counts as one such node of unknown norm: 1). Further upstream the error is merged
  into larger gradients (a residual stream) and is not counted: with every
  upstream node counted in full, the prediction ranked backward sampling far
  below weight-gradient sampling, which training did not bear out;
* **forward sampling** trains a smaller network consistently — its input and
  weight gradients are the exact gradients of the sampled forward — and pays
  with the gap between that forward and the exact one that evaluation runs,
  which training narrows (the weights adapt to the sampled forward): it adds
  ``FORWARD_DISCOUNT · (bias_out² + noise_out²) / N``, the discount ``1/3``. The
  output's noise is not discounted over steps: an unbiased forward (CRS) is a
  different function each step, and its noise compounds through the layers above.
  A layer with no parameterised node downstream (the head: its output is what
  the loss reads) gets no discount and is not averaged over the ``N`` nodes: no
  layer above can adapt to its mismatch, and the loss's gradient it changes is
  what every parameterised node's gradient is computed from, so it adds
  ``bias_out² + noise_out²`` whole. Discounted, the char-LSTM's head was planned
  at forward top-k 0.25 (predicted 0.224) and trained to +17.8% validation loss;
  undiscounted but averaged, a character LM's head was the only layer sampled, at
  the same keep-ratio (0.987 of the FLOPs), and fine-tuned to +13.4%
  (``benchmarks/output_layer.py``, "0.5, blocks whole"). In a
  stitched planning graph the head is the region the model's output is computed
  from (``passes/capture/regions.py``, ``output_modules``).

This is a first-order model measured at the example batch's weights. The two
constants (``noise_horizon`` 30, the forward discount 1/3) were fitted to eleven
fixed plans trained on the char transformer (BENCHMARKS.md, "planner"): there
the predicted errors order 52 of the 55 pairs of plans as their loss increases do. On the
MLP of ``bench_planner.py`` forward sampling costs more than the model says
(60 steps leave little time to adapt).
"""

from __future__ import annotations

import math

import networkx as nx
import torch
import torch.fx

from fxapprox.op_kinds.registry import handler_for
from fxapprox.passes.analysis.graph_view import to_networkx
from fxapprox.passes.measurement.candidates import parameterised
from fxapprox.pipeline.records import DOWNSTREAM_OUTSIDE_KEY, UPSTREAM_OUTSIDE_KEY, ActivationNorms, Candidate, norms_of

__all__ = ["FORWARD_DISCOUNT", "one_draw_errors", "output_layers", "predicted_contribution", "propagation_weights"]


def _share(part: float | None, whole: float | None) -> float:
    """``min(1, (part / whole)²)``: how much of a relative error of ``part`` reaches a tensor of norm ``whole``
    (1 when a norm is unknown: the conservative bound)."""
    if part is None or whole is None or whole <= 0.0:
        return 1.0
    return min(1.0, (part / whole) ** 2)


def _nearest_owners(graph: nx.DiGraph, sources: list[str], owners) -> set[str]:
    """The parameterised nodes first reached going upstream from ``sources`` (a source itself included)."""
    found, seen, frontier = set(), set(), list(sources)
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in owners:
            found.add(name)
            continue
        frontier.extend(graph.predecessors(name))
    return found


def propagation_weights(gm: torch.fx.GraphModule, nodes=None) -> tuple[dict[str, float], int]:
    """``({node: input-gradient weight}, N parameterised nodes)``; see the module docstring.

    The weight sums, over the parameterised nodes first reached upstream of the node's activation
    inputs, ``min(1, (‖dX_node‖ / ‖dY_owner‖)²)`` (norms from the measurement pass; 1 when unknown).
    ``nodes``: the nodes to weigh (default: every approximable layer).
    """
    graph = to_networkx(gm, records=False)
    owners = {n.name: norms_of(n) or ActivationNorms() for n in gm.graph.nodes if parameterised(gm, n)}
    # a region's input in a stitched planning graph comes from code outside the graph that has parameters
    # upstream: it counts as one owner of unknown norm (the conservative share, 1)
    reached = owners.keys() | {n.name for n in gm.graph.nodes if n.meta.get(UPSTREAM_OUTSIDE_KEY)}
    weights: dict[str, float] = {}
    if nodes is None:
        nodes = [n for n in gm.graph.nodes if handler_for(n) is not None]
    for node in nodes:
        handler = handler_for(node)
        norms = norms_of(node) or ActivationNorms()
        if handler is not None:
            weight_positions = set(handler.gradient_operands(gm, node)[0])
        else:   # any other node: its parameter operands are its weights
            weight_positions = {i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node)
                                and a.op == "get_attr" and parameterised(gm, a)}
        sources = [a.name for i, a in enumerate(node.args)
                   if isinstance(a, torch.fx.Node) and i not in weight_positions]
        sources += [a.name for a in node.kwargs.values() if isinstance(a, torch.fx.Node)]
        # summed in name order, not the set's hash order: the same plan whatever PYTHONHASHSEED
        weights[node.name] = sum(_share(norms.input_grad, owners[a].output_grad) if a in owners
                                 else 1.0 for a in sorted(_nearest_owners(graph, sources, reached)))
    return weights, max(1, len(owners))


#: forward sampling's output mismatch counts a third as much as a gradient's bias of the same size: a network
#: trained with the sampled forward adapts to it (calibrated on the char transformer, see BENCHMARKS.md)
FORWARD_DISCOUNT = 1 / 3


def output_layers(gm: torch.fx.GraphModule) -> set[str]:
    """The nodes with no parameterised node downstream (heads): nothing above them adapts to a forward error."""
    # One reverse walk (users come after their inputs in an fx graph), not a descendants search per node.
    feeds_owner: set = set()
    for node in reversed(gm.graph.nodes):
        # a region's output that the model's eager code reads on (a stitched planning graph) feeds its parameters
        if node.meta.get(DOWNSTREAM_OUTSIDE_KEY) \
                or any(user in feeds_owner or parameterised(gm, user) for user in node.users):
            feeds_owner.add(node)
    return {n.name for n in gm.graph.nodes if n not in feeds_owner}


def predicted_contribution(errors: dict, input_weight: float, owners: int, mode: str = "backward",
                           bias: dict | None = None, noise: dict | None = None, *, head: bool = False) -> float:
    """A candidate's share of the squared model-gradient error (see the module docstring).

    In forward mode the output's noise counts whole when ``bias`` and ``noise`` are given: a noisy forward
    is a different function each step, and its error compounds through the layers above within the step.
    ``head``: the node has no parameterised node downstream, so its forward mismatch is neither discounted nor
    averaged over the ``owners``: it reaches every node's gradient through the loss.
    """
    if mode == "forward":
        output = errors.get("output", 0.0) ** 2
        if bias is not None and noise is not None:
            output = bias.get("output", 0.0) ** 2 + noise.get("output", 0.0) ** 2
        # the head's output error is the loss's input error: it changes the gradient of every parameterised node
        return output if head else FORWARD_DISCOUNT * output / owners
    return (errors.get("weight_grad", 0.0) ** 2 + input_weight * errors.get("input_grad", 0.0) ** 2) / owners


def one_draw_errors(candidate: Candidate) -> dict:
    """A measured candidate's errors in one draw, ``sqrt(bias² + noise²)`` per quantity (its ``errors`` average the
    noise over ``noise_horizon`` steps)."""
    bias, noise = candidate.bias, candidate.noise
    if bias is None or noise is None:
        return dict(candidate.errors or {})
    return {name: math.hypot(bias.get(name, 0.0), noise.get(name, 0.0)) for name in bias}
