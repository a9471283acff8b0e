"""What the sampled ops need to know about the step they run in: one context object in a ``ContextVar``.

* ``compressor`` — the saved-activation compressor of the forward running (``fxapprox.runtime.saved_activations``), or
  ``None``: a sampled op that saves a copy of part of its input (the gathered columns ``x[:, S]``, a tensor the
  memory plan never saw as a graph value) tells it through :func:`note_derived`, and the copy inherits the
  compression of ``x``;
* ``derivation_recorder`` — ``callback(derived, source)`` for the same copies, while the saved-bytes analysis
  attributes their bytes to ``x`` (:func:`record_derivations`);
* ``analysing_attention`` — attention takes its compressed-training path outside a compressing forward (the
  analysis passes, :func:`fxapprox.ops.attention.as_in_compressed_training`);
* ``isolate_draws`` — the sampled ops draw from a fork of the RNG (a guarded step, ``fxapprox.runtime.guard``).

Kept apart from :mod:`fxapprox.runtime.saved_activations` so the op modules need not import the hooks machinery.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TrainingContext", "current", "note_derived", "record_derivations", "training_context"]


@dataclass(frozen=True)
class TrainingContext:
    """The sampled ops' view of the step running (see the module docstring)."""

    compressor: Any = None
    derivation_recorder: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    analysing_attention: bool = False
    isolate_draws: bool = False


_CONTEXT: contextvars.ContextVar[TrainingContext] = contextvars.ContextVar("fxapprox_training_context",
                                                                          default=TrainingContext())


def current() -> TrainingContext:
    """The context of the code running now."""
    return _CONTEXT.get()


@contextlib.contextmanager
def training_context(**changes):
    """Inside the block, the current context with ``changes`` (restored after, also on error).

    Example::

        >>> with training_context(isolate_draws=True):
        ...     loss = model(x).sum()
    """
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), **changes))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def note_derived(derived: torch.Tensor, source: torch.Tensor) -> None:
    """Record that ``derived`` (about to be saved for backward) copies part of ``source``."""
    context = _CONTEXT.get()
    if context.compressor is not None:
        context.compressor.tag_like(derived, source)
    if context.derivation_recorder is not None:
        context.derivation_recorder(derived, source)


def record_derivations(callback):
    """``callback(derived, source)`` for every :func:`note_derived` call inside the block."""
    return training_context(derivation_recorder=callback)
