"""Shared by the text examples: the CPython standard library's sources as a character-level corpus."""

from __future__ import annotations

import os
import pathlib

import torch


def load_corpus(max_bytes: int) -> str:
    """The standard library's ``.py`` sources, in sorted order, up to ``max_bytes`` characters.

    Every machine with Python has them: the files next to ``os.py``.
    """
    root = pathlib.Path(os.__file__).parent
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "".join(parts)[:max_bytes]


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    """Character ids of ``text`` and the sorted vocabulary."""
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), vocab


def windows(data: torch.Tensor, seq: int, batch: int, generator: torch.Generator, batch_first: bool = True):
    """Endless random (input, target) windows of ``seq`` characters, ``batch`` at a time."""
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])   # (batch, seq + 1)
        if not batch_first:
            window = window.t()
            yield window[:-1], window[1:]
        else:
            yield window[:, :-1], window[:, 1:]
