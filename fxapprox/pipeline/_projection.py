"""The loss the analyses and ``fxapprox.bench`` backpropagate when the user gives none."""

from __future__ import annotations

import torch


def first_tensor(output):
    """The first tensor in a (possibly nested) model output."""
    if isinstance(output, (tuple, list)):
        return first_tensor(output[0])
    if isinstance(output, dict):
        return first_tensor(next(iter(output.values())))
    return output


def projection_direction(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A fixed random tensor shaped like ``output`` (same seed, same direction)."""
    return torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)).to(output.device)


def projection_loss(output, direction: torch.Tensor | None = None) -> torch.Tensor:
    """``(first output · R).sum()`` for a fixed random ``R``: a loss whose gradients reach every layer.

    Not ``output.sum()``: behind a training-mode BatchNorm the gradient of a sum is ~0 (the
    normalisation removes the mean), and comparing gradients that are only rounding noise
    says nothing about the approximation.
    """
    output = first_tensor(output)
    if direction is None:
        direction = projection_direction(output)
    return (output.float() * direction).sum()
