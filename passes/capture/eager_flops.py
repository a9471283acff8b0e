"""Analysis of eager parts: the FLOPs each eager module's own code spends in one real training step.

``FlopCounterMode`` attributes every forward op to the modules it ran in. An eager module's own forward FLOPs
are its count less its captured descendants' (traced regions, swapped leaves, eager modules below it), which the
planning graph counts itself; what a parameter-free child (rotary embedding, attention kernel) spends is its eager
parent's. Its per-module *backward* attribution is not reliable with nested modules (a child's count can exceed
its parent's: backward ops are charged to whichever module's backward hook fired last), so only the whole step's
backward is taken from it: the eager code's share of it is the step's backward less the regions' (counted op by
op on the planning graph), split among the eager modules in proportion to their forward FLOPs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxapprox.passes.capture.regions import Capture
from fxapprox.pipeline._projection import projection_loss

__all__ = ["count_eager_flops", "count_step_flops"]


def _per_module(model: nn.Module, run) -> dict[str, int]:
    with FlopCounterMode(display=False) as counter:
        run()
    root = type(model).__name__
    counts = {}
    for name, ops in counter.get_flop_counts().items():
        if name.startswith(root + "."):
            counts[name[len(root) + 1:]] = int(sum(ops.values()))
    # the whole step from the global count: backward ops outside every tracked module's backward hooks (T5's) are
    # only there; nothing else runs under the counter (the projection loss has no FLOP-counted op)
    counts[""] = int(counter.get_total_flops())
    return counts


def _step(model: nn.Module, args: tuple, kwargs: dict, backward: bool) -> None:
    output = model(*args, **kwargs)
    if backward:
        loss = projection_loss(output)
        parameters = [p for p in model.parameters() if p.requires_grad]
        if loss.requires_grad and parameters:
            # .backward, not autograd.grad: FlopCounterMode's module tracker cannot follow autograd.grad where a
            # module's input is a leaf (Mamba's parameters passed to submodules); the .grad it writes is put back
            kept = [p.grad for p in parameters]
            loss.backward(inputs=parameters)
            for parameter, grad in zip(parameters, kept):
                parameter.grad = grad


def count_step_flops(model: nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, int], dict[str, int]]:
    """``(forward, forward + backward)`` FLOPs per module path (``""``: the whole model) of one step."""
    with torch.enable_grad():
        forward = _per_module(model, lambda: _step(model, args, kwargs, backward=False))
        total = _per_module(model, lambda: _step(model, args, kwargs, backward=True))
    return forward, total


def _nearest_captured_ancestor(path: str, captured: set[str]) -> str | None:
    while path:
        path = path.rpartition(".")[0]
        if path in captured:
            return path
    return None


def count_eager_flops(capture: Capture, forward: dict[str, int], step_total: int,
                      regions_backward: int) -> dict[str, tuple[int, int]]:
    """``{eager module path: (forward FLOPs, backward FLOPs)}`` of its own code, from :func:`count_step_flops`'s
    per-module forward counts, the whole step's FLOPs and the regions' backward FLOPs.

    Example::

        >>> forward, total = count_step_flops(model, (input_ids,), {"labels": input_ids})
        >>> count_eager_flops(capture, forward, total[""], regions_backward)[""]   # the root's own code
    """
    captured = {r.path for r in capture.regions}
    own = {r.path: forward.get(r.path, 0) for r in capture.regions if r.kind == "eager"}
    for region in capture.regions:
        parent = _nearest_captured_ancestor(region.path, captured) if region.path else None
        if parent is not None and parent in own:
            own[parent] -= forward.get(region.path, 0)
    own = {path: max(flops, 0) for path, flops in own.items()}
    backward = max(step_total - forward.get("", 0) - regions_backward, 0)
    share = sum(own.values())
    return {path: (flops, round(backward * flops / share) if share else 0) for path, flops in own.items()}
