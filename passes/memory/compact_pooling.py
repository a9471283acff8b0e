"""Pass 6a — when activations are compressed, max pools save 8-bit window offsets, not int64 indices.

Replaces ``nn.MaxPool2d`` modules and ``F.max_pool2d`` calls (no dilation, no
``return_indices``) with :func:`fxapprox.ops.pooling.compact_max_pool2d`:
exactly the same forward and backward, 1 byte instead of 8 saved per output.
MaxPool2d has no parameters, so ``state_dict`` keys do not change.
"""

from __future__ import annotations

import inspect

import torch.fx
import torch.nn.functional as F
from torch import nn

from fxapprox.ops.pooling import compact_max_pool2d, compactable

# ``F.max_pool2d`` is a ``boolean_dispatch`` wrapper whose signature is ``(*args, **kwargs)``; the
# parameter names are those of the function it dispatches to.
_MAX_POOL_PARAMS = list(inspect.signature(F.max_pool2d_with_indices).parameters)[1:]


def _functional_arguments(node: torch.fx.Node) -> dict:
    values = dict(zip(_MAX_POOL_PARAMS, node.args[1:]))
    values.update({k: v for k, v in node.kwargs.items() if k != "input"})
    return values


def compact_max_pools(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Swap every compactable max pool for :func:`compact_max_pool2d`; returns ``gm`` (recompiled).

    Example::

        >>> gm = compact_max_pools(torch.fx.symbolic_trace(torchvision.models.resnet18()))
        >>> [n.target.__name__ for n in gm.graph.nodes if n.name == "maxpool"]
        ['compact_max_pool2d']
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.MaxPool2d:
            pool = gm.get_submodule(node.target)
            if not compactable(pool.kernel_size, pool.dilation, pool.return_indices):
                continue
            x = node.args[0] if node.args else node.kwargs["input"]
            args = (x, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode)
        elif node.op == "call_function" and node.target is F.max_pool2d:
            values = _functional_arguments(node)
            if not compactable(values.get("kernel_size"), values.get("dilation", 1),
                               values.get("return_indices", False)):
                continue
            x = node.args[0] if node.args else node.kwargs["input"]
            args = (x, values["kernel_size"], values.get("stride"), values.get("padding", 0),
                    values.get("ceil_mode", False))
        else:
            continue
        node.op, node.target, node.args, node.kwargs = "call_function", compact_max_pool2d, args, {}
    gm.graph.lint()
    gm.recompile()
    return gm
