"""What a budget policy decides for one layer (shared by the measured, FLOP-ranked and uniform policies)."""

from __future__ import annotations

from dataclasses import dataclass

from fxapprox.records import Candidate

#: FLOP comparisons' slack (sums of integers held as floats)
TOLERANCE = 1e-9


@dataclass
class Choice:
    """A policy's decision for one layer: the candidate (or ``None``: exact) and why."""

    candidate: Candidate | None
    reason: str
    predicted_error: float | None = None
