"""Argument checks shared by the public API and the configs.

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError``
for one out of range, naming the argument and the allowed range.
"""

from __future__ import annotations

import math
import numbers


def check_fraction(name: str, value: object, *, allow_zero: bool = False,
                   allow_none: bool = False) -> float | None:
    """Return ``value`` as a float in (0, 1] (or [0, 1] with ``allow_zero``)."""
    if value is None and allow_none:
        return None
    interval = "[0, 1]" if allow_zero else "(0, 1]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in {interval}, got {type(value).__name__} {value!r}")
    result = float(value)
    if math.isnan(result):
        raise ValueError(f"{name} must be a real number in {interval}, got NaN")
    low_ok = result >= 0.0 if allow_zero else result > 0.0
    if not low_ok or result > 1.0:
        raise ValueError(f"{name} must be in {interval}, got {result!r}")
    return result


def check_share(name: str, value: object) -> float:
    """Return ``value`` as a float in [0, 1) (a share of something that must keep a remainder)."""
    result = check_fraction(name, value, allow_zero=True)
    if result >= 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {result!r}")
    return result


def check_positive(name: str, value: object) -> float:
    """Return ``value`` as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive real number, got {type(value).__name__} {value!r}")
    result = float(value)
    if not (math.isfinite(result) and result > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return result


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` as an int ≥ ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_choice(name: str, value: object, choices) -> str:
    """Return ``value`` if it is one of ``choices`` (strings)."""
    allowed = ", ".join(repr(c) for c in sorted(choices))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {allowed}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
