"""The measured policy's last step: between two grid points of a layer's keep-ratio.

The measured policy takes whole candidates, on the ``keep_ratios`` grid; the last one taken usually cuts more
FLOPs than the budget needs. :func:`trim_overshoot` makes layers taken last exact again where the budget is met
without them; :func:`raise_last_ratio` raises the next one's keep-ratio to the fewest pairs that still meet
the budget, with its FLOPs exact and its errors, speed-up and time saving interpolated linearly in ``k`` between
the grid points around it (same mode and method, or the exact op).
"""

from __future__ import annotations

import dataclasses
import math

from fxapprox.op_kinds.registry import handler_for
from fxapprox.passes.policy.policy_types import TOLERANCE as _TOLERANCE
from fxapprox.pipeline.records import train_flops

__all__ = ["raise_last_ratio", "trim_overshoot"]


def _interpolate(low, high, weight: float, key: str):
    """``low``'s ``key`` moved ``weight`` of the way to ``high``'s (``high is None``: the exact op — 0 error,
    speed-up 1); ``None`` when ``low`` has no value. ``low`` and ``high`` are candidates, or for the ``errors``,
    ``bias`` and ``noise`` fields their dicts."""
    def value(record, name):
        return record.get(name) if isinstance(record, dict) else getattr(record, name)
    own = value(low, key)
    if own is None:
        return None
    if isinstance(own, dict):
        return {name: _interpolate(own, None if high is None else value(high, key), weight, name) for name in own}
    target = (1.0 if key == "speedup" else 0.0) if high is None else value(high, key)
    return None if target is None else own + weight * (target - own)


def trim_overshoot(chosen: dict, usable: dict, overshoot: float) -> float:
    """Give back what the plan cuts beyond the budget, from the layers taken last: a layer whose whole saving fits in
    what is left over becomes exact again (it is not needed), the first that does not has its keep-ratio raised
    (:func:`raise_last_ratio`). Returns the change of the squared error."""
    change = 0.0
    for node in reversed(list(chosen)):
        if overshoot <= _TOLERANCE:
            break
        current = chosen[node]
        if current.saving <= overshoot + _TOLERANCE:
            del chosen[node]
            overshoot -= current.saving
            change -= current.contribution
            continue
        change += raise_last_ratio(chosen, usable, overshoot, node)
        break
    return change


def raise_last_ratio(chosen: dict, usable: dict, overshoot: float, node=None) -> float:
    """Raise the keep-ratio of ``node`` (default: the layer taken last) so the plan cuts no more FLOPs than the budget
    needs.

    The new ratio may pass grid points above its own (same mode and method); between the two grid points around it
    (or the last one and the exact op) the FLOPs are exact and the errors, speed-up and time saving are interpolated
    linearly in ``k``. Returns the change of the squared error.
    """
    node = list(chosen)[-1] if node is None else node
    low = chosen[node]
    n = low.n
    per_pair = low.saving / (n - low.k) if n > low.k else 0.0
    if per_pair <= 0:
        return 0.0
    k = min(n - 1, low.k + math.floor(overshoot / per_pair + _TOLERANCE))
    if k <= low.k:
        return 0.0
    grid = sorted((c for c in usable[node] if c.mode == low.mode and c.method == low.method and k >= c.k >= low.k),
                  key=lambda c: c.k)
    below = grid[-1] if grid else low
    above = [c for c in usable[node] if c.mode == low.mode and c.method == low.method and c.k > k]
    high = min(above, key=lambda c: c.k) if above else None
    if below.k == k:
        raised = below
    else:
        k_high = high.k if high is not None else n
        weight = (k - below.k) / (k_high - below.k)
        flops = handler_for(node).candidate_flops(node, low.mode, k / n)
        interpolated = {key: _interpolate(below, high, weight, key)
                        for key in ("contribution", "step_contribution", "step_cost", "speedup", "time_saving",
                                    "net_cost", "errors", "bias", "noise", "raw_contribution", "raw_step_contribution",
                                    "raw_step_cost")}
        raised = dataclasses.replace(below, k=k, keep_ratio=k / n, interpolated=True, flops=flops,
                                     saving=train_flops(node) - flops,
                                     predicted_error=math.sqrt(max(interpolated["contribution"], 0.0)), **interpolated)
    chosen[node] = raised
    return raised.contribution - low.contribution
