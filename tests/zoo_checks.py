"""What the zoo checks (torchvision, timm, Hugging Face) report about the budget and untraceable modules."""

from __future__ import annotations

from torch import nn

from fxapprox.passes.capture.regions import holds_layers
from fxapprox.plan import Plan, exact_reason_groups

__all__ = ["budget_reached", "untraceable_modules"]


def budget_reached(plan: Plan) -> str:
    """``"yes"``, or ``"no (0.943): <why the exact layers with most FLOPs stay exact>"``."""
    if plan.budget_met:
        return "yes"
    exact = [d for d in plan.layers if not d.approximate]
    groups = sorted(exact_reason_groups(exact), key=lambda group: -sum(d.exact_flops for d in group[1]))
    share = lambda members: sum(d.exact_flops for d in members) / plan.total_exact_flops  # noqa: E731
    why = "; ".join(f"{text[:70]} ({share(members):.0%} of FLOPs)" for text, members in groups[:1])
    return f"no ({plan.achieved:.3f}): {why}"


def untraceable_modules(model: nn.Module, plan: Plan) -> tuple[list[str], list[str]]:
    """``(captured, kept_exact)``: the submodules torch.fx could not trace (or was asked not to) that hold layers,
    captured region by region, and those without layers, which stay exact; a module holding layers in a model not
    captured region by region is a coverage failure the checks raise on."""
    captured, kept = [], []
    for untraced in plan.untraced:
        with_layers = holds_layers(model.get_submodule(untraced["module"]))
        (captured if with_layers else kept).append(untraced["module"])
        if with_layers and not plan.regions:
            raise AssertionError(f"{untraced['module']} does not trace and holds approximable layers, yet the "
                                 f"model was not captured region by region: its layers are out of the plan")
    return captured, kept
