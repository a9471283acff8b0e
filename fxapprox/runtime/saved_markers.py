"""The marker nodes the memory rewrite puts in the graph (``fxapprox.passes.memory.rewrite_saved``): they tell the
compressing forward running (:class:`fxapprox.runtime.saved_activations.SavedTensorCompressor`) what to do with a graph
value's saved tensors, and do nothing outside one (eval, ``no_grad``, ``set_approximate(False)``)."""

from __future__ import annotations

import torch.fx

from fxapprox.ops.training_context import current
from fxapprox.runtime.recompute import RECOMPUTABLE_FUNCTIONS
from fxapprox.runtime.saved_activations import without_cast_following

__all__ = ["EagerCopies", "compress_saved", "recompute_saved"]


def compress_saved(value, bits: int, sign_exact: bool = False) -> None:
    """Graph node inserted by the memory rewrite: save ``value`` for backward at ``bits`` bits.

    Does nothing outside a compressing training forward (eval, ``no_grad``,
    ``set_approximate(False)``).
    """
    compressor = current().compressor
    if compressor is not None:
        with without_cast_following():
            compressor.tag(value, bits, sign_exact)


def recompute_saved(value, source, recipe, args: tuple, kwargs: dict) -> None:
    """Graph node inserted by the memory rewrite: rebuild ``value`` in backward instead of saving it.

    ``value`` is ``recipe(*args, **kwargs)`` with ``source`` among the arguments; ``recipe`` is a module or a
    name in :data:`RECOMPUTABLE_FUNCTIONS` (``"method:tanh"`` for a method). Whatever autograd saves from
    ``value`` keeps only a reference to the source's saved copy. Does nothing outside a compressing training
    forward.
    """
    compressor = current().compressor
    if compressor is None:
        return
    if isinstance(recipe, str):
        if recipe.startswith("method:"):
            method = recipe.split(":", 1)[1]
            function = (lambda name: lambda self, *a, **k: getattr(self, name)(*a, **k))(method)
        else:
            function = RECOMPUTABLE_FUNCTIONS[recipe]
    else:
        function = recipe
    with without_cast_following():
        compressor.tag_recompute(value, source, function, args, kwargs)


# Not dead code to torch.fx: they have no users, but they must run where they stand.
torch.fx.node.has_side_effect(compress_saved)
torch.fx.node.has_side_effect(recompute_saved)


class EagerCopies:
    """Forward hooks on the modules of a region-captured model whose memory plan keeps eager code's saves as
    copies: while an eager module runs, what its own code saves (and no region saves) is packed at ``bits`` when it
    ends; on a region's module (``bits=None``) they mark what it saves as the region's. Does nothing outside a
    compressing training forward."""

    def __init__(self, bits: int | None, min_bytes: int) -> None:
        self.bits = bits
        self.min_bytes = min_bytes

    def enter(self, module, args, kwargs=None) -> None:
        compressor = current().compressor
        if compressor is not None:
            compressor.enter_eager(self.bits, self.min_bytes, module)

    def leave(self, module, args, output) -> None:
        compressor = current().compressor
        if compressor is not None:
            with without_cast_following():
                compressor.exit_eager(module)

    def install(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave, always_call=True)
