"""Pass 4c's last phase: the plan's note and warnings, in words a user reads in the report.

The note says what the plan does against what was asked (the budget met, or why not and the lowest fraction the
model reaches, naming the layers that cannot be sampled and why) and what the pay-off model predicts. The
warnings say what the user should know before trusting a numeric budget: it was spent past ``max_grad_error``,
or on layers measured no faster than the exact op, or it is out of reach.
"""

from __future__ import annotations

from fxapprox.config import ApproxConfig
from fxapprox.passes.policy.policy_types import PolicySummary
from fxapprox.plan import exact_reason_groups

__all__ = ["plan_note", "unreachable_text"]


def unreachable_text(decisions, total: float, limit: int = 3) -> str:
    """``"31% of training FLOPs are in layers that cannot be sampled: reduces over 3 channels < … (1: conv1); …"``"""
    blocked = [d for d in decisions if not d.approximate and not _sampleable(d)]
    share = sum(d.exact_flops for d in blocked) / total if total else 0.0
    groups = exact_reason_groups(blocked)
    parts = [f"{text} ({len(members)}: {_names(members)})" for text, members in groups[:limit]]
    if len(groups) > limit:
        parts.append(f"{len(groups) - limit} more reason(s)")
    return f"{share:.0%} of training FLOPs are in layers that cannot be sampled" + (
        ": " + "; ".join(parts) if parts else "")


def _sampleable(decision) -> bool:
    """Exact layers whose reason is a choice of the policy, not a blocker (they had candidates)."""
    return decision.reason.startswith(("not needed", "not sampled", "max_grad_error", "budget 1.0"))


def _names(members, limit: int = 3) -> str:
    names = [d.target for d in members[:limit]]
    return ", ".join(names) + (f" and {len(members) - limit} more" if len(members) > limit else "")


def _prediction(summary: PolicySummary) -> str:
    if summary.payoff is None or summary.predicted_speedup is None:
        return ""
    gain = summary.predicted_gain
    timing = (f"{gain:.2f}x sooner" if gain >= 1 else
              "never" if gain == 0 else f"{1 / gain:.2f}x later")
    return (f"; predicted {summary.predicted_speedup:.2f}x faster per step, {summary.predicted_steps:.2f}x the "
            f"steps: {timing} to the same loss")


def plan_note(budget, total: float, planned: float, met: bool, decisions, config: ApproxConfig,
              summary: PolicySummary) -> tuple[str, list[str]]:
    """``(note, warnings)`` for a plan."""
    achieved = planned / total if total else 1.0
    if total == 0:
        return "the model does no measured FLOPs: nothing to approximate", []
    auto = budget == "auto"
    if not auto and budget >= 1.0:
        return "budget 1.0: the plan is exact", []
    sampled = sum(d.approximate for d in decisions)
    error = "" if config.policy != "measured" else f", predicted model-gradient error " \
                                                     f"{summary.squared_error ** 0.5:.3f}"
    if auto:
        if not sampled:
            best = f" (the best sampled plan: {summary.unpaid})" if summary.unpaid else ""
            return (f"budget auto: no sampled plan is predicted to reach a given loss sooner than exact training"
                    f"{best}; the model trains exactly. A numeric budget (approximate(model, 0.5)) is spent as "
                    f"asked"), []
        tail = (". Sampling more is predicted to cost more training steps than it saves time"
                if summary.stopped_for_gain else "")
        return (f"budget auto: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs{error}"
                f"{_prediction(summary)}{tail}"), []
    warnings = []
    if config.policy == "uniform":
        note = (f"uniform recipe (keep-ratio {config.keep_ratio:g} for layers with >= {config.min_channels} "
                f"channels): {sampled} layer(s) sampled, planned {achieved:.3f} of exact training FLOPs; "
                f"budget {budget:g} {'met' if met else 'not met'}")
    elif met:
        note = (f"budget {budget:g} met: {sampled} layer(s) sampled, planned {achieved:.3f} of exact training "
                f"FLOPs{error}{_prediction(summary)}")
    else:
        tail = ("every layer's candidates are used at their lowest keep-ratio" if config.policy == "measured"
                else f"sampled layers stop at min_keep_ratio={config.min_keep_ratio:g}")
        note = (f"budget {budget:g} not reachable: planned {achieved:.3f} of exact training FLOPs{error}"
                f"{_prediction(summary)}. {unreachable_text(decisions, total)}; {tail}")
        warnings.append(f"budget {budget:g} not reachable: {achieved:.3f} of exact training FLOPs is the least this "
                        f"model's candidates reach (see the note for the layers that cannot be sampled)")
    if summary.over_tolerance:
        warnings.append(f"predicted model-gradient error {summary.squared_error ** 0.5:.3f} > max_grad_error="
                        f"{config.max_grad_error:g}: budget {budget:g} is spent as asked, and the prediction says it "
                        f"may cost accuracy")
    if summary.slow_layers:
        slow = [d for d in decisions if d.node in summary.slow_layers]
        warnings.append(f"{len(slow)} layer(s) sampled although measured slower than min_speedup="
                        f"{config.min_speedup:g} ({_names(slow)}): budget {budget:g} needs their FLOPs, the step "
                        f"need not get faster for them")
    return note, warnings
