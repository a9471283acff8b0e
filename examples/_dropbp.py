"""A DropBP-style baseline, written from the paper's description (Woo et al., "DropBP: Accelerating Fine-Tuning of
Large Language Models by Dropping Backward Propagation", 2024), for the comparison in ``llama_lm.py``.

Each residual sub-block ``x + f(x)`` (a decoder layer's attention and its MLP) keeps its forward; with probability
``p_i`` its backward is dropped for the step: ``f(x)`` is detached, so no gradient flows into ``f`` (nor into its
input norm) and its weights get none, while the residual path carries the gradient on. Rates are allocated by
measured sensitivity: a sub-block's sensitivity is how far the model's gradient moves when its backward alone is
dropped (squared relative distance, averaged over a few batches); the rates minimise the total sensitivity
``Σ s_i p_i`` at the target backward FLOPs, within ``±spread`` of the uniform rate (the paper bounds its rates
around the target too).
"""

from __future__ import annotations

import random

import torch
from torch import nn


class DropBackward:
    """Forward hooks on ``blocks`` (name → module whose output is a residual branch) that detach its output with
    probability ``rates[name]`` in training mode."""

    def __init__(self, blocks: dict[str, nn.Module], seed: int = 0) -> None:
        self.blocks = blocks
        self.rates = {name: 0.0 for name in blocks}
        self.forced: set[str] = set()
        self.random = random.Random(seed)
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in blocks.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            if not module.training or not torch.is_grad_enabled():
                return output
            if name not in self.forced and self.random.random() >= self.rates[name]:
                return output
            if isinstance(output, tuple):
                return (output[0].detach(), *output[1:])
            return output.detach()
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def sensitivities(model: nn.Module, drop: DropBackward, batches, loss_fn) -> dict[str, float]:
    """Each block's sensitivity: ``|g − g_without_its_backward|² / |g|²`` averaged over ``batches``."""
    parameters = [p for p in model.parameters() if p.requires_grad]

    def gradient(batch) -> torch.Tensor:
        grads = torch.autograd.grad(loss_fn(model, batch), parameters, allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, parameters)])

    saved, drop.rates = drop.rates, {name: 0.0 for name in drop.blocks}
    scores = {name: 0.0 for name in drop.blocks}
    try:
        for batch in batches:
            full = gradient(batch)
            for name in drop.blocks:
                drop.forced = {name}
                scores[name] += float((full - gradient(batch)).square().sum() / full.square().sum()) / len(batches)
                drop.forced = set()
    finally:
        drop.rates, drop.forced = saved, set()
    return scores


def allocate(scores: dict[str, float], flops: dict[str, float], target: float, spread: float = 0.25,
             highest: float = 0.95) -> dict[str, float]:
    """Rates minimising ``Σ scores·p`` with ``Σ flops·p = target·Σ flops``, each within ``target ± spread``
    (and ``[0, highest]``): start every block at its lowest rate, then raise the least sensitive per FLOP first."""
    low = {n: max(0.0, target - spread) for n in scores}
    high = {n: min(highest, target + spread) for n in scores}
    rates = dict(low)
    needed = target * sum(flops.values()) - sum(flops[n] * rates[n] for n in scores)
    for name in sorted(scores, key=lambda n: scores[n] / max(flops[n], 1.0)):
        if needed <= 0:
            break
        room = (high[name] - rates[name]) * flops[name]
        step = min(room, needed)
        rates[name] += step / flops[name]
        needed -= step
    return rates
