"""The measured policy's last step: between two grid points of a layer's keep-ratio.

The measured policy takes whole candidates, on the ``keep_ratios`` grid; the last one taken usually cuts more
FLOPs than the budget needs. :func:`raise_last_ratio` raises its keep-ratio to the fewest pairs that still meet
the budget, with its FLOPs exact and its errors, speed-up and time saving interpolated linearly in ``k`` between
its grid point and the next one up (same mode and method, or the exact op).
"""

from __future__ import annotations

import dataclasses
import math

from fxapprox.op_kinds import handler_for
from fxapprox.passes.policy_types import TOLERANCE as _TOLERANCE
from fxapprox.records import train_flops

__all__ = ["raise_last_ratio"]


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


def raise_last_ratio(chosen: dict, usable: dict, overshoot: float) -> float:
    """Raise the keep-ratio of the layer taken last so the plan cuts no more FLOPs than the budget needs.

    Between its grid point and the next one up (same mode and method, or the exact op) the FLOPs are exact
    and the errors, speed-up and time saving are interpolated linearly in ``k``. Returns the change of the squared
    error.
    """
    node = list(chosen)[-1]
    low = chosen[node]
    n = low.n
    above = [c for c in usable[node] if c.mode == low.mode and c.method == low.method and c.k > low.k]
    high = min(above, key=lambda c: c.k) if above else None
    k_high = high.k if high is not None else n
    per_pair = low.saving / (n - low.k) if n > low.k else 0.0
    if per_pair <= 0:
        return 0.0
    k = min(k_high - 1, low.k + math.floor(overshoot / per_pair + _TOLERANCE))
    if k <= low.k:
        return 0.0
    weight = (k - low.k) / (k_high - low.k)
    flops = handler_for(node).candidate_flops(node, low.mode, k / n)
    interpolated = {key: _interpolate(low, high, weight, key)
                    for key in ("contribution", "step_contribution", "step_cost", "speedup", "time_saving", "errors",
                                "bias", "noise")}
    raised = dataclasses.replace(low, k=k, keep_ratio=k / n, interpolated=True, flops=flops,
                                 saving=train_flops(node) - flops,
                                 predicted_error=math.sqrt(max(interpolated["contribution"], 0.0)), **interpolated)
    chosen[node] = raised
    return raised.contribution - low.contribution
