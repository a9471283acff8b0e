"""Modules the rewrite pass puts into the graph in place of planned nodes.

``ApproxLinear`` and ``ApproxConv2d`` take over the *same* Parameter objects
as the layer they replace, under the same attribute names, so ``state_dict``
keys do not change. The functional wrappers hold no parameters at all. Every
module computes the exact op in ``eval()`` mode and when approximation is
switched off (``set_approximate(False)``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxapprox._validate import check_choice, check_int
from fxapprox.ops.conv import sampled_conv2d
from fxapprox.ops.linear import sampled_linear
from fxapprox.ops.sampling import METHODS


@dataclass(frozen=True)
class SamplingSpec:
    """What one approximated node does: keep ``k`` of ``n`` pairs with ``method``."""

    method: str
    k: int
    n: int

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_int("n", self.n, minimum=1)
        check_int("k", self.k, minimum=1)
        if self.k > self.n:
            raise ValueError(f"k must be in [1, n={self.n}], got {self.k}")

    @property
    def keep_ratio(self) -> float:
        return self.k / self.n

    def to_dict(self) -> dict:
        return asdict(self)


class ApproxOp:
    """Mixin for every approximate module: a spec and an on/off switch."""

    fxapprox_spec: SamplingSpec
    fxapprox_enabled: bool

    def _init_approx(self, spec: SamplingSpec) -> None:
        self.fxapprox_spec = spec
        self.fxapprox_enabled = True

    @property
    def approximating(self) -> bool:
        """True when the next forward call samples (training mode, switched on)."""
        return self.training and self.fxapprox_enabled and self.fxapprox_spec.k < self.fxapprox_spec.n

    def extra_repr(self) -> str:  # type: ignore[override]
        base = super().extra_repr()  # type: ignore[misc]
        spec = self.fxapprox_spec
        text = f"method={spec.method}, k={spec.k}/{spec.n}, enabled={self.fxapprox_enabled}"
        return f"{base}, {text}" if base else text


def _adopt(cls, original: nn.Module):
    """A ``cls`` instance that shares ``original``'s parameters, buffers and hooks."""
    new = cls.__new__(cls)
    new.__dict__.update(original.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(original.__dict__[key])
    return new


class ApproxLinear(ApproxOp, nn.Linear):
    """``nn.Linear`` whose training forward keeps ``k`` of ``in_features`` pairs."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: SamplingSpec) -> "ApproxLinear":
        if spec.n != linear.in_features:
            raise ValueError(f"spec.n={spec.n} does not match in_features={linear.in_features}")
        new = _adopt(cls, linear)
        new._init_approx(spec)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.approximating:
            return F.linear(x, self.weight, self.bias)
        spec = self.fxapprox_spec
        return sampled_linear(x, self.weight, self.bias, spec.k, spec.method)


def resolve_conv_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """Numeric (symmetric) padding of ``conv``, or ``None`` when it cannot be expressed so."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0, 0)
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in total):
            return None
        return (total[0] // 2, total[1] // 2)
    return tuple(conv.padding)


class ApproxConv2d(ApproxOp, nn.Conv2d):
    """``nn.Conv2d`` (groups=1) whose training forward keeps ``k`` of the input channels."""

    @classmethod
    def from_conv2d(cls, conv: nn.Conv2d, spec: SamplingSpec) -> "ApproxConv2d":
        if conv.groups != 1:
            raise ValueError(f"only groups=1 convolutions can be sampled, got groups={conv.groups}")
        if spec.n != conv.in_channels:
            raise ValueError(f"spec.n={spec.n} does not match in_channels={conv.in_channels}")
        padding = resolve_conv_padding(conv)
        if padding is None:
            raise ValueError("asymmetric 'same' padding cannot be sampled")
        new = _adopt(cls, conv)
        new._init_approx(spec)
        new._numeric_padding = padding
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.approximating:
            return self._conv_forward(x, self.weight, self.bias)
        spec = self.fxapprox_spec
        padding = self._numeric_padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        return sampled_conv2d(x, self.weight, self.bias, spec.k, self.stride, padding,
                              self.dilation, spec.method)


class ApproxFunctionalLinear(ApproxOp, nn.Module):
    """Stands in for a ``F.linear(x, weight, bias)`` call; holds no parameters."""

    def __init__(self, spec: SamplingSpec) -> None:
        super().__init__()
        self._init_approx(spec)

    def forward(self, x, weight, bias=None):
        if not self.approximating:
            return F.linear(x, weight, bias)
        return sampled_linear(x, weight, bias, self.fxapprox_spec.k, self.fxapprox_spec.method)


class ApproxMatmul(ApproxOp, nn.Module):
    """Stands in for ``a @ b`` where one operand is a 2-D parameter; holds no parameters.

    ``parameter_side="right"``: ``x @ W`` (W is ``(n, out)``) = ``linear(x, Wᵀ)``.
    ``parameter_side="left"``: ``W @ x`` (W is ``(out, n)``) = ``linear(xᵀ, W)ᵀ``.
    """

    def __init__(self, spec: SamplingSpec, parameter_side: str) -> None:
        super().__init__()
        self._init_approx(spec)
        self.parameter_side = check_choice("parameter_side", parameter_side, {"left", "right"})

    def forward(self, a, b):
        if not self.approximating:
            return torch.matmul(a, b)
        spec = self.fxapprox_spec
        if self.parameter_side == "right":
            return sampled_linear(a, b.t(), None, spec.k, spec.method)
        return sampled_linear(b.transpose(-1, -2), a, None, spec.k, spec.method).transpose(-1, -2)

    def extra_repr(self) -> str:
        return f"parameter_side={self.parameter_side}, " + super().extra_repr()


APPROX_MODULE_TYPES = (ApproxLinear, ApproxConv2d, ApproxFunctionalLinear, ApproxMatmul)
