"""Pass 1b — training flags: make traced ``training=self.training`` arguments follow the mode again.

``torch.fx`` records ``F.dropout(x, p, training=self.training)`` (and
torchvision's wrapped ``stochastic_depth`` / ``shifted_window_attention``) with
the Python bool the module had *at trace time*, so the traced graph would keep
dropping out after ``eval()``. This pass finds every ``call_function`` node
whose target has a ``training`` (or ``train``) parameter bound to a constant
bool and routes it through a parameter-free :class:`ModeFollowingCall`
submodule that passes its own ``self.training`` instead.
"""

from __future__ import annotations

import inspect

import torch.fx
from torch import nn

FLAG_NAMES = ("training", "train")


class ModeFollowingCall(nn.Module):
    """Calls ``function`` with its training flag set to this module's ``self.training``."""

    def __init__(self, function, flag: str, position: int | None) -> None:
        super().__init__()
        self.function, self.flag, self.position = function, flag, position

    def forward(self, *args, **kwargs):
        if self.position is not None and self.position < len(args):
            args = args[: self.position] + (self.training,) + args[self.position + 1:]
        else:
            kwargs[self.flag] = self.training
        return self.function(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{getattr(self.function, '__qualname__', self.function)}, {self.flag}=self.training"


def _constant_flag(node: torch.fx.Node) -> tuple[str, int | None] | None:
    try:
        signature = inspect.signature(node.target)
        bound = signature.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call that does not bind
        return None
    for flag in FLAG_NAMES:
        if isinstance(bound.arguments.get(flag), bool):
            position = list(signature.parameters).index(flag)
            return flag, (position if position < len(node.args) else None)
    return None


def follow_training_mode(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite constant training flags into ones that follow ``gm.train()`` / ``gm.eval()``.

    Example::

        >>> gm = follow_training_mode(trace(model_with_dropout))
        >>> gm.eval()   # dropout now off, as in the original model
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not callable(node.target):
            continue
        found = _constant_flag(node)
        if found is None:
            continue
        flag, position = found
        name = f"fxapprox_mode_{node.name}"
        gm.add_submodule(name, ModeFollowingCall(node.target, flag, position))
        node.op, node.target = "call_module", name
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
