"""Least-error allocation under a budget: the multiple-choice knapsack both measured policies solve.

Each item (a layer, a saved value) has options — records (``fxapprox.pipeline.records.Candidate``, a saved
value's ``BitsOption``) with a ``saving`` (FLOPs or bytes, > 0) and a ``contribution`` (its predicted
squared error) — besides "leave it exact" at (0, 0). Each item's options are reduced to their lower
convex hull; the hull steps of all items are taken in order of least error per unit saved (the greedy
solution of the Lagrangian relaxation, optimal at the hull vertices) until ``needed`` is saved, skipping
steps that would take the total past ``error_cap²``; last, each chosen item gets the least-cost option
of its own that still meets ``needed`` (the final step may overshoot).
"""

from __future__ import annotations

_TOLERANCE = 1e-9


def lower_hull(options: list, x: str = "saving", y: str = "contribution") -> list:
    """The options on the lower convex hull of (``x``, ``y``) from (0, 0), by ``x`` (options with ``x`` ≤ 0 left
    out)."""
    points = sorted(((getattr(o, x), getattr(o, y), i) for i, o in enumerate(options)
                     if getattr(o, x) is not None and getattr(o, x) > 0))
    hull: list[tuple] = [(0, 0.0, None)]
    for point in points:
        if point[0] == hull[-1][0] and point[1] >= hull[-1][1]:
            continue
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the segment from hull[-2] to the new point
            if (y2 - y1) * (point[0] - x1) >= (point[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(point)
    return [options[i] for _, _, i in hull[1:]]


def least_error_allocation(items: list, options: dict, needed: float, error_cap: float | None,
                           objective=None, rate: tuple[str, str] = ("saving", "contribution")
                           ) -> tuple[dict, float, float, set]:
    """``(chosen option per item, saved, total contribution, items whose next step the cap refused)``.

    ``objective(chosen, saved, total)``: when given, the steps stop at the prefix where it is highest (the
    empty prefix included): taking more would lower it. ``rate``: the (benefit, cost) keys whose hull the
    steps follow, cheapest cost per benefit first (``("time_saving", "step_cost")`` walks towards the highest
    speed-up per extra step; the budget is still counted in ``saving``, the cap in ``contribution``).

    Example::

        >>> from types import SimpleNamespace as Option
        >>> opts = {"a": [Option(saving=10, contribution=1.0)], "b": [Option(saving=10, contribution=0.1)]}
        >>> least_error_allocation(["a", "b"], opts, 10, None)[0]
        {'b': namespace(saving=10, contribution=0.1)}
    """
    benefit, cost = rate
    steps = []
    refused: set = set()   # items with options the cap refuses on their own
    for order, item in enumerate(items):
        previous, previous_saving, previous_error = (0.0, 0.0), 0, 0.0
        # Options past the cap on their own can never be taken: left out before the hull, so that a hull on
        # another rate does not hide an item's smaller, admissible options behind them.
        admissible = [o for o in options.get(item, []) if error_cap is None
                      or o.contribution <= error_cap ** 2 + _TOLERANCE]
        if len(admissible) < len(options.get(item, [])):
            refused.add(item)
        for depth, option in enumerate(lower_hull(admissible, benefit, cost)):
            extra_saving, extra_error = option.saving - previous_saving, option.contribution - previous_error
            key = (getattr(option, cost) - previous[1]) / (getattr(option, benefit) - previous[0])
            steps.append((key, order, depth, item, option, extra_saving, extra_error))
            previous, previous_saving, previous_error = (getattr(option, benefit), getattr(option, cost)), \
                option.saving, option.contribution
    steps.sort(key=lambda s: s[:3])
    chosen: dict = {}
    saved, total = 0.0, 0.0
    capped: set = set()
    best = (objective(chosen, saved, total), dict(chosen), saved, total) if objective is not None else None
    for *_, item, option, extra_saving, extra_error in steps:
        if saved >= needed - _TOLERANCE:
            break
        if item in capped:
            continue
        if error_cap is not None and total + extra_error > error_cap ** 2 + _TOLERANCE:
            capped.add(item)
            continue
        chosen[item] = option
        saved += extra_saving
        total += extra_error
        if objective is not None:
            value = objective(chosen, saved, total)
            if value > best[0] + _TOLERANCE:
                best = (value, dict(chosen), saved, total)
    capped |= refused
    if objective is not None:
        _, chosen, saved, total = best
    # Last, the least-cost option that still meets ``needed`` (not with an objective: it chose the prefix, and
    # a lower-cost option may cost it).
    for item in (reversed(list(chosen)) if objective is None else ()):
        current = chosen[item]
        for option in sorted(options[item], key=lambda o: getattr(o, cost)):
            if getattr(option, cost) >= getattr(current, cost):
                break
            if error_cap is not None and total - current.contribution + option.contribution > \
                    error_cap ** 2 + _TOLERANCE:
                continue
            if saved - current.saving + option.saving >= needed - _TOLERANCE:
                saved += option.saving - current.saving
                total += option.contribution - current.contribution
                chosen[item] = option
                break
    return chosen, saved, total, capped
