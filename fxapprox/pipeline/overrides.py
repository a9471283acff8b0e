"""Per-layer rules of a config (``ApproxConfig(overrides=...)``): pin the plan for layers matched by name,
regular expression or module type."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from fxapprox._validate import check_choice, check_fraction
from fxapprox.ops.sampling import METHODS
from fxapprox.runtime.modules import MODES

__all__ = ["LayerOverride"]


@dataclass(frozen=True)
class LayerOverride:
    """Pin the plan for the layers ``pattern`` matches.

    ``pattern`` is a module type (``nn.Linear``), or a string matched against the
    layer's qualified name (``"layer4.0.conv2"``, the graph node name, or the
    module path): first exactly, then as a regular expression with
    ``re.fullmatch``.

    Example::

        >>> LayerOverride("fc", exclude=True)                 # keep the classifier exact
        >>> LayerOverride(r"layer4\\..*", keep_ratio=0.25)    # sample layer4 harder
    """

    pattern: str | type
    keep_ratio: float | None = None
    method: str | None = None
    mode: str | None = None
    exclude: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pattern, str):
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {error}") from None
        elif not (isinstance(self.pattern, type) and issubclass(self.pattern, nn.Module)):
            raise TypeError(f"pattern must be a str or an nn.Module subclass, got {self.pattern!r}")
        check_fraction("keep_ratio", self.keep_ratio, allow_none=True)
        if self.method is not None:
            check_choice("method", self.method, METHODS)
        if self.mode is not None:
            check_choice("mode", self.mode, MODES)
        if not isinstance(self.exclude, bool):
            raise TypeError(f"exclude must be a bool, got {self.exclude!r}")
        if self.exclude and (self.keep_ratio is not None or self.method is not None or self.mode is not None):
            raise ValueError("exclude=True cannot be combined with keep_ratio, method or mode")

    def matches(self, names: tuple[str, ...], module: nn.Module | None) -> bool:
        """Whether this override applies to a layer known by ``names`` (and its module)."""
        if isinstance(self.pattern, type):
            return module is not None and isinstance(module, self.pattern)
        if self.pattern in names:
            return True
        return any(re.fullmatch(self.pattern, name) for name in names if name)

    def describe(self) -> str:
        return self.pattern.__name__ if isinstance(self.pattern, type) else repr(self.pattern)
