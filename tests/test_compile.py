"""torch.compile: top-k sampled ops compile with no graph break (``fullgraph=True``), forward and backward, and
give eager's results; the random methods and compressed activations may break the graph but must work.

The op-level tests use the ``aot_eager`` backend (dynamo + AOTAutograd, which traces the backward too, without
inductor's code generation, to keep the suite fast); one test runs inductor on a whole approximated model.
"""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear, ApproxLSTM, ApproxMatmul, SamplingSpec


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _linear(mode):
    return ApproxLinear.from_linear(nn.Linear(64, 32), SamplingSpec("topk", 16, 64, mode)), (torch.randn(8, 64),)


def _conv(mode):
    conv = nn.Conv2d(8, 6, 3, padding=1)
    return ApproxConv2d.from_conv2d(conv, SamplingSpec("topk", 4, 8, mode)), (torch.randn(2, 8, 6, 6),)


class _MatmulHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32) / 8)
        self.matmul = ApproxMatmul(SamplingSpec("topk", 16, 64), "right")

    def forward(self, x):
        return self.matmul(x, self.weight)


def _lstm(mode):
    lstm = nn.LSTM(16, 32, num_layers=2, bidirectional=True)
    return ApproxLSTM.from_lstm(lstm, SamplingSpec("topk", 8, 32)), (torch.randn(5, 3, 16),)


CASES = {
    "linear forward": lambda: _linear("forward"),
    "linear backward": lambda: _linear("backward"),
    "linear weight_grad": lambda: _linear("weight_grad"),
    "conv2d forward": lambda: _conv("forward"),
    "conv2d backward": lambda: _conv("backward"),
    "conv2d weight_grad": lambda: _conv("weight_grad"),
    "matmul": lambda: (_MatmulHolder(), (torch.randn(8, 64),)),
    "lstm": lambda: _lstm("backward"),
}


def _loss(module, *inputs):
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return out.square().mean()


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_top_k_sampled_ops_compile_without_graph_breaks(case):
    module, inputs = CASES[case]()
    module.train()
    explanation = torch._dynamo.explain(_loss)(module, *inputs)
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    torch._dynamo.reset()
    eager_loss = _loss(module, *inputs)
    eager_loss.backward()
    eager = _grads(module)
    module.zero_grad()
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    compiled_loss = compiled(module, *inputs)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    for name, grad in _grads(module).items():
        torch.testing.assert_close(grad, eager[name], msg=name)


@pytest.mark.parametrize("method", ["crs", "bernoulli", "wta_crs"])
def test_random_methods_run_compiled(method):
    """Their kept count is data-dependent (a host sync): dynamo may break the graph, the step must still run."""
    module = ApproxLinear.from_linear(nn.Linear(64, 32), SamplingSpec(method, 16, 64)).train()
    x = torch.randn(8, 64)
    loss = torch.compile(_loss, backend="aot_eager")(module, x)
    loss.backward()
    assert torch.isfinite(module.weight.grad).all() and module.weight.grad.abs().sum() > 0


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("memory_budget", [None, 0.25])
def test_compiled_approximated_model_matches_eager(memory_budget):
    """``torch.compile(approx)`` (inductor) trains like the eager approximated model; with a memory plan the
    compressor's hooks may break the graph, the gradients must not change."""
    model = _MLP()
    x = torch.randn(64, 128)
    target = torch.randint(0, 10, (64,))
    approx = fxapprox.approximate(model, budget=0.5, memory_budget=memory_budget, example_inputs=(x,), method="topk",
                                  config=fxapprox.ApproxConfig(policy="flops", random_share=0.0)).train()
    assert any(isinstance(m, ApproxLinear) for m in approx.modules())
    torch.manual_seed(1)
    F.cross_entropy(approx(x), target).backward()
    eager = _grads(approx)
    approx.zero_grad()
    compiled = torch.compile(approx)
    torch.manual_seed(1)
    if memory_budget is None:
        F.cross_entropy(compiled(x), target).backward()
    else:
        with pytest.warns(RuntimeWarning, match="runs eagerly under torch.compile"):
            F.cross_entropy(compiled(x), target).backward()
    for name, grad in _grads(approx).items():
        if memory_budget is None:
            torch.testing.assert_close(grad, eager[name], msg=name, atol=1e-5, rtol=1e-4)
        else:   # stochastic rounding draws differ between the eager and compiled packing
            cosine = F.cosine_similarity(grad.flatten(), eager[name].flatten(), dim=0)
            assert cosine > 0.99, (name, float(cosine))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torch_export_of_an_approximated_model(mode):
    """``torch.export``: eval exports the exact graph; training mode keeps the sampled ops (the LSTM as its
    custom op) and gives the same outputs as the module."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.lstm, self.head = nn.Linear(64, 128), nn.LSTM(128, 64), nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.lstm(F.relu(self.fc(x)))[0])

    x = torch.randn(5, 8, 64)
    approx = fxapprox.approximate(Net(), 0.5, example_inputs=(x,), method="topk",
                                  config=fxapprox.ApproxConfig(policy="flops", random_share=0.0))
    getattr(approx, mode)()
    exported = torch.export.export(approx, (x,))
    custom = [n for n in exported.graph.nodes if "fxapprox" in str(n.target)]
    assert bool(custom) == (mode == "train")
    torch.testing.assert_close(exported.module()(x), approx(x))
