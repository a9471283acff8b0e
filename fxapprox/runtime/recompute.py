"""Recomputed saved values: which ops the memory plan may rebuild in backward instead of storing their output, and
the saved-tensor stand-in that rebuilds one (:class:`RecomputedCopy`).
"""

from __future__ import annotations

import torch

from fxapprox.ops.quantize import QuantizedTensor

__all__ = ["RECOMPUTABLE_FUNCTIONS", "RECOMPUTABLE_METHODS", "RECOMPUTABLE_MODULES", "RecomputedCopy", "rebuild_view"]

#: Functions whose output the memory plan may rebuild in backward from its input's saved copy instead of storing it
#: (``recipe`` names in ``recompute_saved`` nodes): elementwise activations and normalisations, cheap next to the
#: matmuls around them and deterministic. The same ops as modules: :data:`RECOMPUTABLE_MODULES`.
RECOMPUTABLE_FUNCTIONS = {
    "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "mish": torch.nn.functional.mish,
    "hardswish": torch.nn.functional.hardswish, "elu": torch.nn.functional.elu,
    "softplus": torch.nn.functional.softplus, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "layer_norm": torch.nn.functional.layer_norm, "group_norm": torch.nn.functional.group_norm,
    # not cheap: rebuilt only with ApproxConfig(activation_recompute="linear")
    "linear": torch.nn.functional.linear,
}
if hasattr(torch.nn.functional, "rms_norm"):  # torch >= 2.4
    RECOMPUTABLE_FUNCTIONS["rms_norm"] = torch.nn.functional.rms_norm
#: methods (``x.tanh()``) rebuilt the same way
RECOMPUTABLE_METHODS = ("tanh", "sigmoid")
#: module types rebuilt the same way (not when built ``inplace=True``)
RECOMPUTABLE_MODULES = tuple(getattr(torch.nn, name) for name in (
    "GELU", "SiLU", "Mish", "Hardswish", "ELU", "Softplus", "Tanh", "Sigmoid", "LayerNorm", "GroupNorm", "RMSNorm")
    if hasattr(torch.nn, name))


def rebuild_view(full: torch.Tensor, base: tuple, view: tuple) -> torch.Tensor:
    """The view ``view`` (size, stride, offset) of a tensor laid out like ``base``, cut from ``full``'s values."""
    size, stride, offset = base
    if tuple(full.stride()) != tuple(stride) or full.shape != size:
        laid_out = torch.empty_strided(size, stride, dtype=full.dtype, device=full.device)
        laid_out.copy_(full)
        full = laid_out
    view_size, view_stride, view_offset = view
    return full.as_strided(view_size, view_stride, full.storage_offset() + view_offset - offset)


class RecomputedCopy:
    """A saved tensor that keeps nothing of its own: backward re-runs ``recipe`` on the source's saved copy.

    ``source`` is the source value's :class:`QuantizedTensor` (or the tensor itself, when it is kept exact:
    autograd holds it anyway), ``source_shape`` its ``(shape, stride)`` (stride ``None``: a copy in logical
    order); ``args``/``kwargs`` are the op's other arguments with ``None`` where the source
    goes (``slot``).
    """

    __slots__ = ("source", "source_shape", "recipe", "args", "kwargs", "slot", "base", "view", "dtype", "autocast")
    nbytes = 0

    def __init__(self, source, source_shape, recipe, args, kwargs, slot, base: tuple, view: tuple, dtype,
                 autocast: tuple) -> None:
        self.source, self.source_shape, self.recipe = source, source_shape, recipe
        self.args, self.kwargs, self.slot = args, kwargs, slot
        self.base, self.view, self.dtype = base, view, dtype
        # (device type, autocast dtype or None): backward re-runs the op under the autocast of its forward
        self.autocast = autocast

    def dequantize(self) -> torch.Tensor:
        source = self.source
        if isinstance(source, QuantizedTensor):
            shape, stride = self.source_shape
            rebuilt = source.dequantize()
            source = rebuilt.as_strided(shape, stride) if stride is not None else rebuilt.view(shape)
        elif isinstance(source, RecomputedCopy):   # a chain: the source is rebuilt first, in its own view
            source = source.dequantize()
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(self.slot, int):
            args[self.slot] = source
        else:
            kwargs[self.slot] = source
        device, autocast_dtype = self.autocast
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            full = self.recipe(*args, **kwargs)
        return rebuild_view(full.to(self.dtype), self.base, self.view)
