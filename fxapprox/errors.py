"""Exceptions raised by fxapprox."""

from __future__ import annotations


class FxApproxError(Exception):
    """Base class of every error fxapprox raises on purpose."""


class TraceError(FxApproxError):
    """The model could not be captured as a ``torch.fx`` graph.

    The message names the module and the source line where tracing failed, and
    suggests the fix: mark that module a leaf (``ApproxConfig(leaf_modules=...)``)
    or trace the model yourself and pass the ``torch.fx.GraphModule``.
    """

    def __init__(self, message: str, *, module_path: str | None = None, source_line: str | None = None,
                 module_type: str | None = None, reason: str | None = None, location: str | None = None) -> None:
        super().__init__(message)
        self.module_path = module_path
        self.source_line = source_line
        self.module_type = module_type   #: the failing module's class name
        self.reason = reason             #: the underlying error, one line
        self.location = location         #: ``file:line: `code``` of the user line, when found


class AnalysisError(FxApproxError, RuntimeError):
    """The model failed while the analysis passes ran it on the example inputs."""


class PlanNotReadyError(FxApproxError, RuntimeError):
    """The plan (and so the report) is made on the first batch; none was seen yet."""
