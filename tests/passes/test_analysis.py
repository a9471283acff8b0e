import networkx as nx
import torch
import torch.nn.functional as F
from torch import nn

from fxapprox.passes import (annotate_channels, count_flops, measure_saved_bytes, propagate_shapes,
                             rank_layers, to_networkx, trace)
from fxapprox.pipeline.records import flops_of, kind_of, saved_of, tensor_of


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.wide = nn.Conv2d(16, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)
        self.proj = nn.Parameter(torch.randn(10, 20))

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = self.dw(x)
        x = F.relu(self.wide(x))
        return self.fc(x.mean((2, 3))) @ self.proj


def _analysed(batch=2):
    gm = trace(Net())
    x = torch.randn(batch, 3, 8, 8)
    count_flops(gm, x)
    propagate_shapes(gm, x)
    measure_saved_bytes(gm, x)
    annotate_channels(gm)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_shapes_and_channels():
    _, meta = _analysed()
    assert tensor_of(meta["wide"]).shape == [2, 64, 8, 8] and tensor_of(meta["wide"]).dtype == "float32"
    assert kind_of(meta["wide"]).op_kind == "conv2d" and kind_of(meta["wide"]).reduction_size == 16
    assert kind_of(meta["dw"]).groups == 16
    assert kind_of(meta["fc"]).in_channels == 64 and kind_of(meta["fc"]).out_channels == 10
    assert kind_of(meta["matmul"]).op_kind == "matmul" and kind_of(meta["matmul"]).parameter_side == "right"
    assert kind_of(meta["matmul"]).reduction_size == 10


def test_flops_forward_and_backward_per_node():
    _, meta = _analysed(batch=2)
    # conv forward: 2 * N * Cout * H * W * Cin * kh * kw
    assert flops_of(meta["wide"]).forward == 2 * 2 * 64 * 8 * 8 * 16 * 9
    assert flops_of(meta["wide"]).backward == 2 * flops_of(meta["wide"]).forward     # dX and dW
    assert flops_of(meta["stem"]).backward == flops_of(meta["stem"]).forward         # no input gradient
    assert flops_of(meta["fc"]).forward == 2 * 2 * 64 * 10
    assert flops_of(meta["relu"]).forward == 0


def test_saved_bytes_exclude_parameters():
    _, meta = _analysed(batch=2)
    # Linear saves its input (2x64 fp32); the weight is a parameter, not an activation.
    assert saved_of(meta["fc"]).bytes == 2 * 64 * 4
    assert saved_of(meta["matmul"]).bytes == 2 * 10 * 4
    assert saved_of(meta["wide"]).bytes == 2 * 16 * 8 * 8 * 4


def test_rank_prefers_expensive_wide_layers():
    gm, _ = _analysed()
    ranked = [n.name for n in rank_layers(gm)]
    assert ranked[0] == "wide"
    assert set(ranked) == {"stem", "dw", "wide", "fc", "matmul"}


def test_networkx_view():
    gm, _ = _analysed()
    graph = to_networkx(gm)
    assert nx.is_directed_acyclic_graph(graph)
    assert graph.has_edge("stem", "relu")
    assert graph.nodes["wide"]["fxapprox"]["op_kind"] == "conv2d"


def test_lstm_flops_formula():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    gm = trace(Model())
    count_flops(gm, torch.randn(3, 5, 8))
    node = next(n for n in gm.graph.nodes if n.target == "lstm")
    expected = 2 * 3 * 5 * 64 * (8 + 16)
    assert flops_of(node).forward == expected
    assert flops_of(node).backward == 2 * expected


def test_sparse_lstm_flops_are_counted_and_shrink_with_the_keep_ratio():
    """Our LSTM runs its products through oneDNN's linear; FlopCounterMode must see them (a formula is registered),
    with nn.LSTM's count at keep-ratio 1 and a backward proportional to the kept gate columns."""
    from torch.utils.flop_counter import FlopCounterMode

    from fxapprox.ops.lstm import sparse_backward_lstm_layer

    steps, batch, inputs, hidden = 5, 4, 8, 16
    lstm = nn.LSTM(inputs, hidden)
    x = torch.randn(steps, batch, inputs, requires_grad=True)
    h0 = torch.zeros(batch, hidden)
    weights = (lstm.weight_ih_l0, lstm.weight_hh_l0, lstm.bias_ih_l0, lstm.bias_hh_l0)
    forward_flops = 2 * steps * batch * 4 * hidden * (inputs + hidden)
    with FlopCounterMode(display=False) as reference:
        lstm(x)[0].sum().backward()
    assert reference.get_total_flops() == 3 * forward_flops
    for keep_ratio in (1.0, 0.5, 0.25):
        with FlopCounterMode(display=False) as forward:
            outputs, _, _ = sparse_backward_lstm_layer(x, h0, h0, *weights, keep_ratio=keep_ratio)
        with FlopCounterMode(display=False) as backward:
            outputs.sum().backward()
        assert forward.get_total_flops() == forward_flops
        assert backward.get_total_flops() == round(2 * forward_flops * keep_ratio)


def test_cudnn_lstm_flop_formulas_match_the_onednn_ones():
    """The CUDA (cuDNN) LSTM kernels get the same count as oneDNN's: 2·T·B·4H·(I + H) per layer and direction
    forward, twice that backward. Checked on the shapes FlopCounterMode hands the formulas (no GPU needed)."""
    from fxapprox.passes.analysis.flops import _cudnn_rnn_backward, _cudnn_rnn_forward

    steps, batch, inputs, hidden = 7, 3, 8, 16
    lstm = nn.LSTM(inputs, hidden, num_layers=2, bidirectional=True)
    shapes = [tuple(w.shape) for w in lstm._flat_weights]
    per_layer = [2 * steps * batch * 4 * hidden * (i + hidden) for i in (inputs, 2 * hidden)]
    expected = 2 * sum(per_layer)   # two directions
    assert _cudnn_rnn_forward((steps, batch, inputs), shapes, 4, None, None, None, 2) == expected
    assert _cudnn_rnn_backward((steps, batch, inputs), shapes, 4) == 2 * expected
    no_bias = nn.LSTM(inputs, hidden, bias=False)
    assert _cudnn_rnn_forward((steps, batch, inputs), [tuple(w.shape) for w in no_bias._flat_weights], 2,
                              None, None, None, 2) == per_layer[0]


def _conv_step_flops(conv: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as forward:
        out = conv(x)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    return forward.get_total_flops(), backward.get_total_flops()


def test_grouped_convolution_backward_is_counted_per_group():
    """torch's formula counts a grouped convolution's weight gradient as if ungrouped; ours: input and weight
    gradients each as many FLOPs as the forward, grouped or not."""
    import torch.utils.flop_counter as flop_counter

    import fxapprox.passes.analysis.flops  # noqa: F401 — registers the formula

    torch.manual_seed(0)
    for conv, x in ((nn.Conv2d(96, 96, 7, padding=3, groups=96), torch.randn(2, 96, 16, 16)),
                    (nn.Conv2d(32, 64, 3, padding=1, groups=4), torch.randn(2, 32, 8, 8)),
                    (nn.Conv1d(64, 64, 4, padding=3, groups=64), torch.randn(2, 64, 16))):
        forward, backward = _conv_step_flops(conv, x.requires_grad_())
        assert backward == 2 * forward
        forward, backward = _conv_step_flops(conv, x.detach())   # no input gradient: the weight's only
        assert backward == forward
    # ungrouped (strided, dilated, transposed): the same count as torch's own formula
    original = flop_counter.conv_backward_flop
    for conv, x in ((nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.randn(2, 16, 9, 9)),
                    (nn.Conv2d(16, 8, 5, dilation=2, padding=4), torch.randn(2, 16, 12, 12)),
                    (nn.ConvTranspose2d(16, 8, 3, stride=2), torch.randn(2, 16, 7, 7))):
        x.requires_grad_()
        out = conv(x)
        grad = torch.ones_like(out)
        expected = original(grad, x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.transposed,
                            conv.output_padding, conv.groups, [True, True, False],
                            out_val=(x, conv.weight, None))
        assert _conv_step_flops(conv, x)[1] == expected
