"""Where sampled ops tell activation saving that a tensor they save is a copy of part of another.

A forward-sampled layer saves the gathered columns ``x[:, S]``, a new tensor the
memory plan never saw as a graph value. :func:`note_derived` lets it inherit
the compression of ``x`` at run time and lets the saved-bytes analysis
attribute its bytes to ``x``. Kept apart from :mod:`fxapprox.saved_activations`
so the op modules need not import the hooks machinery.
"""

from __future__ import annotations

import contextlib
import threading

import torch

local = threading.local()


def note_derived(derived: torch.Tensor, source: torch.Tensor) -> None:
    """Record that ``derived`` (about to be saved for backward) copies part of ``source``."""
    compressor = getattr(local, "compressor", None)
    if compressor is not None:
        compressor.tag_like(derived, source)
    recorder = getattr(local, "derivation_recorder", None)
    if recorder is not None:
        recorder(derived, source)


@contextlib.contextmanager
def local_setting(name: str, value):
    """Set the thread-local ``name`` to ``value`` inside the block (restored after, also on error)."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


def record_derivations(callback):
    """``callback(derived, source)`` for every :func:`note_derived` call inside the block."""
    return local_setting("derivation_recorder", callback)
