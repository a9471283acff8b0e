"""BatchNorm recalibration after approximate training.

BatchNorm's running statistics are collected during training on the
activations the *approximate* forward produced, while evaluation runs the exact
graph. Before evaluating (or exporting weights for deployment) call
:func:`recalibrate_bn` to refresh them with exact forward passes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fxapprox.runtime.modules import APPROX_MODULE_TYPES


def _model_inputs(batch) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        return tuple(first) if isinstance(first, (tuple, list)) else (first,)
    raise TypeError(
        f"recalibrate_bn: each batch must be a tensor or an (inputs, ...) tuple, got {type(batch).__name__}"
    )


def recalibrate_bn(model: nn.Module, batches: Iterable, *, max_batches: int | None = None) -> int:
    """Recompute every BatchNorm's running mean/var with exact forward passes; returns batches used.

    ``batches`` yields a tensor (the model's one input), or a tuple/list as a
    ``DataLoader`` gives it — ``(inputs, target, ...)`` — whose first element is
    the input tensor or a tuple of positional inputs.
    Running statistics are reset and then averaged cumulatively over the
    batches (``momentum=None``); sampling is switched off meanwhile, and the
    module's mode and sampling switch are restored afterwards.

    Example::

        >>> fxapprox.recalibrate_bn(approx, (x for x, _ in itertools.islice(train_loader, 50)))
        >>> approx.eval(); evaluate(approx)
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return 0
    approx_ops = [m for m in model.modules() if isinstance(m, APPROX_MODULE_TYPES)]
    enabled = {m: m.fxapprox_enabled for m in approx_ops}
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in norms}
    used = 0
    try:
        for m in approx_ops:
            m.fxapprox_enabled = False
        for m in norms:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for batch in batches:
                if max_batches is not None and used >= max_batches:
                    break
                model(*_model_inputs(batch))
                used += 1
    finally:
        for m, value in enabled.items():
            m.fxapprox_enabled = value
        for m, value in momenta.items():
            m.momentum = value
        for m, value in modes.items():
            m.training = value
    if used == 0:
        raise ValueError("recalibrate_bn got no batches: pass an iterable of model inputs")
    return used
