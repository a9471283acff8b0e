"""Modules the rewrite pass puts into the graph in place of planned nodes.

``ApproxLinear`` and ``ApproxConv2d`` take over the *same* Parameter objects
as the layer they replace, under the same attribute names, so ``state_dict``
keys do not change. The functional wrappers hold no parameters at all. Every
module computes the exact op in ``eval()`` mode and when approximation is
switched off (``set_approximate(False)``).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxapprox._validate import check_choice, check_int, check_share
from fxapprox.ops.conv import backward_sampled_conv2d, pair_scores_conv2d, sampled_conv2d
from fxapprox.ops.linear import INPUT_SAVING, backward_sampled_linear, pair_scores_linear, sampled_linear
from fxapprox.ops.lstm import LSTMBackward, sparse_backward_lstm_layer
from fxapprox.ops.row_tape import row_linear
from fxapprox.ops.sampling import METHODS

#: where a layer is sampled: its forward product (all three GEMMs shrink), both backward GEMMs, or only the
#: weight-gradient GEMM (forward and input gradient exact)
MODES = ("forward", "backward", "weight_grad")
#: the mode of a linear layer in a row-sampled block (``fxapprox.ops.rows``): forward exact and recorded, its
#: backward on the rows the block keeps, its weight gradient over ``k / n`` of their tokens; the block's sampler
#: decides at run time (``ApproxConfig`` does not offer it per layer: the row policy plans whole blocks)
ROWS = "rows"

@dataclass(frozen=True)
class SamplingSpec:
    """What one approximated node does: keep ``k`` of ``n`` pairs with ``method``.

    ``mode="forward"`` samples the ``n`` reduction pairs of the forward product
    (all three GEMMs shrink); ``mode="backward"`` keeps the forward exact and
    samples both backward GEMMs at keep-ratio ``k / n``; ``mode="weight_grad"``
    samples only the weight-gradient GEMM (over batch rows) at that ratio. ``random_share`` is the
    share of top-k's slots drawn at random (the guard against starved columns). ``save_input`` (forward
    mode): keep the input itself for backward (``"reference"``) or a copy of its kept columns
    (``"gathered"``); see :func:`fxapprox.ops.linear.sampled_linear`.
    """

    method: str
    k: int
    n: int
    mode: str = "forward"
    random_share: float = 0.0
    save_input: str = "reference"

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_choice("mode", self.mode, MODES + (ROWS,))
        check_int("n", self.n, minimum=1)
        check_int("k", self.k, minimum=1)
        if self.k > self.n:
            raise ValueError(f"k must be in [1, n={self.n}], got {self.k}")
        check_share("random_share", self.random_share)
        check_choice("save_input", self.save_input, INPUT_SAVING)

    @property
    def keep_ratio(self) -> float:
        return self.k / self.n

    def to_dict(self) -> dict:
        return asdict(self)


class ApproxOp:
    """Mixin for every approximate module: a spec and an on/off switch."""

    fxapprox_spec: SamplingSpec
    fxapprox_enabled: bool
    #: set by :func:`fxapprox.distributed.register_sampled_allreduce`: picks pairs identically on every rank
    fxapprox_sync = None

    def _init_approx(self, spec: SamplingSpec) -> None:
        self.fxapprox_spec = spec
        self.fxapprox_enabled = True

    @property
    def approximating(self) -> bool:
        """True when the next forward call samples (training mode, switched on); a row-sampled block's layer always
        goes through :func:`~fxapprox.ops.rows.row_linear` (its block decides whether to sample)."""
        spec = self.fxapprox_spec
        return self.training and self.fxapprox_enabled and (spec.k < spec.n or spec.mode == ROWS)

    def pair_scores(self, *args) -> torch.Tensor:
        """The forward-sampling pair scores for the arguments the module is called with."""
        raise NotImplementedError

    def extra_repr(self) -> str:  # type: ignore[override]
        base = super().extra_repr()  # type: ignore[misc]
        spec = self.fxapprox_spec
        text = f"method={spec.method}, mode={spec.mode}, k={spec.k}/{spec.n}, enabled={self.fxapprox_enabled}"
        return f"{base}, {text}" if base else text


def _linear(spec: SamplingSpec, x, weight, bias):
    if spec.mode == ROWS:
        return row_linear(x, weight, bias)
    if spec.mode != "forward":
        return backward_sampled_linear(x, weight, bias, spec.keep_ratio, spec.method, spec.random_share,
                                       sample_input_grad=spec.mode == "backward")
    return sampled_linear(x, weight, bias, spec.k, spec.method, spec.random_share, spec.save_input)


def _conv2d(spec: SamplingSpec, x, weight, bias, stride, padding, dilation):
    if spec.mode != "forward":
        return backward_sampled_conv2d(x, weight, bias, spec.keep_ratio, stride, padding, dilation, spec.method,
                                       spec.random_share, sample_input_grad=spec.mode == "backward")
    return sampled_conv2d(x, weight, bias, spec.k, stride, padding, dilation, spec.method, spec.random_share,
                          spec.save_input)


def _adopt(cls, original: nn.Module):
    """A ``cls`` instance that shares ``original``'s parameters, buffers and hooks."""
    new = cls.__new__(cls)
    new.__dict__.update(original.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(original.__dict__[key])
    return new


def _adopt_linear(cls, original: nn.Module, spec: "SamplingSpec", in_features: int, what: str):
    """:func:`_adopt` for a linear-like layer reducing over ``in_features`` pairs, with ``spec`` checked and set."""
    if spec.n != in_features:
        raise ValueError(f"spec.n={spec.n} does not match {what}={in_features}")
    new = _adopt(cls, original)
    new._init_approx(spec)
    return new


class ApproxLinear(ApproxOp, nn.Linear):
    """``nn.Linear`` whose training forward keeps ``k`` of ``in_features`` pairs."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: SamplingSpec) -> "ApproxLinear":
        return _adopt_linear(cls, linear, spec, linear.in_features, "in_features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.approximating:
            return F.linear(x, self.weight, self.bias)
        if self.fxapprox_sync is not None:
            return self.fxapprox_sync.linear(self, x)
        return _linear(self.fxapprox_spec, x, self.weight, self.bias)

    def pair_scores(self, x):
        return pair_scores_linear(x.reshape(-1, x.shape[-1]), self.weight)


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
        padding = self._numeric_padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        if self.fxapprox_sync is not None:
            return self.fxapprox_sync.conv2d(self, x, padding)
        return _conv2d(self.fxapprox_spec, x, self.weight, self.bias, self.stride, padding, self.dilation)

    def pair_scores(self, x):
        return pair_scores_conv2d(x, self.weight)


class ApproxFunctionalLinear(ApproxOp, nn.Module):
    """Stands in for a ``F.linear(x, weight, bias)`` call; holds no parameters."""

    def __init__(self, spec: SamplingSpec) -> None:
        super().__init__()
        self._init_approx(spec)

    def forward(self, x, weight, bias=None):
        if not self.approximating:
            return F.linear(x, weight, bias)
        return _linear(self.fxapprox_spec, x, weight, bias)

    def pair_scores(self, x, weight, bias=None):
        return pair_scores_linear(x.reshape(-1, x.shape[-1]), weight)


class ApproxFunctionalConv2d(ApproxOp, nn.Module):
    """Stands in for a ``F.conv2d(x, weight, bias, stride, padding, dilation)`` call (groups=1)."""

    def __init__(self, spec: SamplingSpec, stride=1, padding=0, dilation=1) -> None:
        super().__init__()
        self._init_approx(spec)
        self.stride, self.padding, self.dilation = stride, padding, dilation

    def forward(self, x, weight, bias=None):
        if not self.approximating:
            return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, 1)
        return _conv2d(self.fxapprox_spec, x, weight, bias, self.stride, self.padding, self.dilation)

    def pair_scores(self, x, weight, bias=None):
        return pair_scores_conv2d(x, weight)


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
        if self.parameter_side == "right":
            return _linear(self.fxapprox_spec, a, b.t(), None)
        return _linear(self.fxapprox_spec, b.transpose(-1, -2), a, None).transpose(-1, -2)

    def pair_scores(self, a, b):
        if self.parameter_side == "right":
            return pair_scores_linear(a.reshape(-1, a.shape[-1]), b.t())
        x = b.transpose(-1, -2)
        return pair_scores_linear(x.reshape(-1, x.shape[-1]), a)

    def extra_repr(self) -> str:
        return f"parameter_side={self.parameter_side}, " + super().extra_repr()


def lstm_blocker(lstm: nn.LSTM) -> str | None:
    """Why ``lstm`` cannot get a sparse backward, or ``None``."""
    if lstm.proj_size:
        return f"LSTM with proj_size={lstm.proj_size}: sparse backward not supported, stays exact"
    if lstm.weight_hh_l0.dtype not in (torch.float32, torch.float64):
        return f"LSTM in {lstm.weight_hh_l0.dtype}: sparse backward runs in fp32/fp64 only, stays exact"
    return None


class ApproxLSTM(ApproxOp, nn.RNNBase):
    """``nn.LSTM`` whose training backward keeps ``k`` of ``hidden_size`` gate-gradient columns per gate.

    The forward is exact (own implementation while training, ``nn.LSTM``'s otherwise).
    Multiple layers, ``batch_first``, bidirectional, dropout between layers and
    initial states are supported; a ``PackedSequence`` input runs exactly
    (``nn.LSTM``'s kernel) and warns once.

    It is an ``nn.RNNBase`` with ``nn.LSTM``'s methods rather than an ``nn.LSTM`` subclass: torch.compile
    graph-breaks on every ``nn.RNN``/``nn.GRU``/``nn.LSTM`` instance (unless
    ``torch._dynamo.config.allow_rnn``), while this one it traces, each layer and direction of the training
    forward one custom op (:mod:`fxapprox.ops.lstm`).
    """

    get_expected_cell_size = nn.LSTM.get_expected_cell_size
    check_forward_args = nn.LSTM.check_forward_args
    permute_hidden = nn.LSTM.permute_hidden

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM, spec: SamplingSpec, granularity: str = "coarse",
                  block_steps: int = LSTMBackward.block_steps) -> "ApproxLSTM":
        blocker = lstm_blocker(lstm)
        if blocker is not None:
            raise ValueError(blocker)
        if spec.n != lstm.hidden_size:
            raise ValueError(f"spec.n={spec.n} does not match hidden_size={lstm.hidden_size}")
        new = _adopt(cls, lstm)
        new._init_approx(spec)
        options = LSTMBackward(granularity, block_steps)   # validates both
        new.fxapprox_granularity, new.fxapprox_block_steps = options.granularity, options.block_steps
        new.fxapprox_always_own = False
        new._warned_packed = False
        return new

    @property
    def approximating(self) -> bool:
        """True when the next training forward uses the sparse backward (or ``fxapprox_always_own`` is set:
        the own implementation even at keep-ratio 1, for benchmarks and tests of its dense path)."""
        return self.training and self.fxapprox_enabled and (
            self.fxapprox_spec.k < self.fxapprox_spec.n or self.fxapprox_always_own)

    def forward(self, input, hx=None):  # noqa: A002 — nn.LSTM's signature
        if isinstance(input, nn.utils.rnn.PackedSequence):
            if self.approximating and not self._warned_packed:
                warnings.warn("fxapprox: ApproxLSTM got a PackedSequence; its backward runs exactly (pad the "
                              "sequences for the sparse backward)", RuntimeWarning, stacklevel=2)
                self._warned_packed = True
            return nn.LSTM.forward(self, input, hx)
        if not (self.approximating and torch.is_grad_enabled()):
            return nn.LSTM.forward(self, input, hx)
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
        directions = 2 if self.bidirectional else 1
        shape = (self.num_layers * directions, x.shape[1], self.hidden_size)
        if hx is None:
            h0 = c0 = x.new_zeros(shape)
        else:
            h0, c0 = (h.unsqueeze(1) for h in hx) if unbatched else hx
        keep = self.fxapprox_spec.keep_ratio
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                index = layer * directions + direction
                hs, h, c = sparse_backward_lstm_layer(
                    x, h0[index], c0[index], getattr(self, "weight_ih" + suffix), getattr(self, "weight_hh" + suffix),
                    getattr(self, "bias_ih" + suffix, None), getattr(self, "bias_hh" + suffix, None), keep,
                    self.fxapprox_granularity, reverse=bool(direction),
                    block_steps=getattr(self, "fxapprox_block_steps", 1))
                outputs.append(hs)
                h_n.append(h)
                c_n.append(c)
            x = outputs[0] if directions == 1 else torch.cat(outputs, dim=2)
            if self.dropout and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        output = x.squeeze(1) if unbatched else (x.transpose(0, 1) if self.batch_first else x)
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if unbatched:
            h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
        return output, (h_n, c_n)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", granularity={getattr(self, 'fxapprox_granularity', 'coarse')}"
                f", block_steps={getattr(self, 'fxapprox_block_steps', 1)}")


class ApproxConv1D(ApproxOp, nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2's projections: ``x @ weight + bias`` with an ``[in, out]`` weight) whose
    training forward is sampled like an ``nn.Linear`` with weight ``weight.T`` (a view: the gradient reaches the
    same parameter). Exact (``eval()``, switched off) it computes what ``Conv1D`` computes, the same ``addmm``."""

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, spec: SamplingSpec) -> "ApproxConv1D":
        return _adopt_linear(cls, conv1d, spec, conv1d.weight.shape[0], "the Conv1D's input features")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.approximating:
            out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return out.view(*x.shape[:-1], self.weight.shape[1])
        return _linear(self.fxapprox_spec, x, self.weight.t(), self.bias)

    def pair_scores(self, x):
        return pair_scores_linear(x.reshape(-1, x.shape[-1]), self.weight.t())


APPROX_MODULE_TYPES = (ApproxLinear, ApproxConv2d, ApproxFunctionalLinear, ApproxFunctionalConv2d, ApproxMatmul,
                       ApproxLSTM, ApproxConv1D)
