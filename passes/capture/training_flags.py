"""Pass 1b — training flags: make traced ``training=self.training`` arguments follow the mode again.

``torch.fx`` records ``F.dropout(x, p, training=self.training)`` (and
torchvision's wrapped ``stochastic_depth`` / ``shifted_window_attention``, and
``dropout_p=self.p if self.training else 0.``) with the value the module had *at
trace time*, so the traced graph would keep dropping out after ``eval()``.

Which constants depend on the mode is read off two traces of the model, one in
each mode (``counterpart``): an argument of a ``call_function`` node whose value
differs between the train-mode and the eval-mode trace is routed through a
parameter-free :class:`ModeFollowingCall` submodule that passes the value for its
own ``self.training``. An argument that is the same in both (weight
standardisation's ``F.batch_norm(w, None, None, training=True)`` in NF-Nets) is a
real constant and stays. Without a counterpart (or for a node the other trace
lacks) any bool ``training``/``train`` argument is taken to follow the mode.
"""

from __future__ import annotations

import inspect

import torch.fx
import torch.nn.functional as F
from torch import nn

FLAG_NAMES = ("training", "train")


class ModeFollowingCall(nn.Module):
    """Calls ``function`` with the arguments in ``overrides`` (position or keyword →
    ``(value in training, value in eval)``) set for this module's ``self.training``."""

    def __init__(self, function, overrides: dict) -> None:
        super().__init__()
        self.function, self.overrides = function, dict(overrides)

    def forward(self, *args, **kwargs):
        args = list(args)
        for key, (train_value, eval_value) in self.overrides.items():
            value = train_value if self.training else eval_value
            if isinstance(key, int):   # positional in the traced call
                args[key] = value
            else:
                kwargs[key] = value
        return self.function(*args, **kwargs)

    def extra_repr(self) -> str:
        keys = ", ".join(f"{k}=(train {t!r}, eval {e!r})" for k, (t, e) in self.overrides.items())
        return f"{getattr(self.function, '__qualname__', self.function)}, {keys}"


def _bound(node: torch.fx.Node):
    try:
        signature = inspect.signature(node.target)
        return signature, signature.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call that does not bind
        return None, None


def _key(signature, name: str, node: torch.fx.Node):
    position = list(signature.parameters).index(name)
    return position if position < len(node.args) else name


def _flag_by_name(node: torch.fx.Node) -> dict:
    if node.target is F.scaled_dot_product_attention:
        # no flag, a probability: models pass ``dropout_p=self.p if self.training else 0.0`` (Hugging Face
        # traced in training mode bakes in 0.1); attention dropout in eval is never meant
        position = 5 if len(node.args) > 5 else "dropout_p"
        value = node.args[5] if position == 5 else node.kwargs.get("dropout_p", 0.0)
        return {position: (value, 0.0)} if isinstance(value, float) and value > 0 else {}
    signature, bound = _bound(node)
    if bound is None:
        return {}
    for flag in FLAG_NAMES:
        if isinstance(bound.arguments.get(flag), bool):
            return {_key(signature, flag, node): (True, False)}
    return {}


_CONSTANTS = (bool, int, float, type(None))


def _differences(node: torch.fx.Node, other: torch.fx.Node, training: bool) -> dict:
    """Arguments (by position or keyword, as traced) whose constant value differs between this trace (in mode
    ``training``) and the other; compared as written, so builtins without a signature work too."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(node.args, other.args))]
    pairs += [(k, v, other.kwargs[k]) for k, v in node.kwargs.items() if k in other.kwargs]
    found = {}
    for key, value, other_value in pairs:
        if isinstance(value, _CONSTANTS) and isinstance(other_value, _CONSTANTS) and value != other_value:
            found[key] = (value, other_value) if training else (other_value, value)
    return found


def follow_training_mode(gm: torch.fx.GraphModule, counterpart: torch.fx.GraphModule | None = None,
                         training: bool = True) -> torch.fx.GraphModule:
    """Rewrite traced mode-dependent constants into arguments that follow ``gm.train()`` / ``gm.eval()``.

    ``gm`` was traced in mode ``training``; ``counterpart``, if given, is the same model traced in the other.

    Example::

        >>> gm = follow_training_mode(trace(model_with_dropout))
        >>> gm.eval()   # dropout now off, as in the original model
    """
    others = {} if counterpart is None else {n.name: n for n in counterpart.graph.nodes}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not callable(node.target):
            continue
        other = others.get(node.name)
        if other is not None and other.op == node.op and other.target is node.target:
            overrides = _differences(node, other, training)
        else:
            overrides = _flag_by_name(node)
        if not overrides:
            continue
        name = f"fxapprox_mode_{node.name}"
        gm.add_submodule(name, ModeFollowingCall(node.target, overrides))
        node.op, node.target = "call_module", name
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
