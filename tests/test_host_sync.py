"""A training step never waits on the device: no host synchronisation and no data-dependent shape, for every
static method × mode × op kind and for compressed activations (``fxapprox.count_host_syncs``); the sampled ops
compile whole (``fullgraph=True``) with every static method."""

import pytest
import torch
import torch._dynamo
from torch import nn

import fxapprox
import fxapprox.ops.sampling
from fxapprox.config import AUTO_METHODS
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear, ApproxLSTM, ApproxMatmul, SamplingSpec

STATIC_METHODS = ("topk", "crs", "wta_crs")


@pytest.fixture(autouse=True)
def _device_path(monkeypatch):
    """The selectors' device path (what a GPU runs): on CPU tensors CRS and WTA-CRS otherwise select in NumPy,
    where reading values on the host waits on nothing."""
    monkeypatch.setattr(fxapprox.ops.sampling, "CPU_NUMPY", False)


class _MatmulHolder(nn.Module):
    def __init__(self, method: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32) / 8)
        self.matmul = ApproxMatmul(SamplingSpec(method, 16, 64), "right")

    def forward(self, x):
        return self.matmul(x, self.weight)


def _case(kind: str, method: str):
    if kind.startswith("linear"):
        mode = kind.split()[1]
        return ApproxLinear.from_linear(nn.Linear(64, 32), SamplingSpec(method, 16, 64, mode)), (torch.randn(8, 64),)
    if kind.startswith("conv2d"):
        mode = kind.split()[1]
        conv = nn.Conv2d(8, 6, 3, padding=1)
        return ApproxConv2d.from_conv2d(conv, SamplingSpec(method, 4, 8, mode)), (torch.randn(2, 8, 6, 6),)
    if kind == "matmul":
        return _MatmulHolder(method), (torch.randn(8, 64),)
    lstm = nn.LSTM(16, 32, num_layers=2, bidirectional=True)
    return ApproxLSTM.from_lstm(lstm, SamplingSpec(method, 8, 32)), (torch.randn(5, 3, 16),)


KINDS = ("linear forward", "linear backward", "linear weight_grad", "conv2d forward", "conv2d backward",
         "conv2d weight_grad", "matmul", "lstm")


def _loss(module, *inputs):
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    return out.square().mean()


def test_the_counter_sees_what_synchronises():
    x = torch.randn(16)
    with fxapprox.count_host_syncs() as syncs:
        x.sum().item()
        torch.nonzero(x > 0)
        torch.unique(x)
        x.sum() * 2   # no sync
    assert syncs.counts == {"_local_scalar_dense": 1, "nonzero": 1, "_unique2": 1} and syncs.total == 3


@pytest.mark.parametrize("method", STATIC_METHODS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_sampled_training_step_never_waits_on_the_device(kind, method):
    torch.manual_seed(0)
    module, inputs = _case(kind, method)
    with fxapprox.count_host_syncs() as syncs:
        _loss(module, *inputs).backward()
    assert syncs.total == 0, syncs.counts


def test_bernoulli_keeps_a_random_number_of_pairs_and_auto_never_picks_it():
    module, inputs = _case("linear forward", "bernoulli")
    with fxapprox.count_host_syncs() as syncs:
        _loss(module, *inputs).backward()
    assert syncs.counts["nonzero"] >= 1
    assert all("bernoulli" not in methods for methods in AUTO_METHODS.values())


@pytest.mark.parametrize("memory_budget", [0.25, 0.125])
def test_a_step_with_compressed_activations_never_waits_on_the_device(memory_budget):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    x = torch.randn(32, 64)
    approx = fxapprox.approximate(model, 0.5, memory_budget=memory_budget, example_inputs=(x,),
                                  config=fxapprox.ApproxConfig(check_every=None, min_gain=None, min_speedup=None,
                                                               activation_min_bytes=0, min_channels=8))
    assert approx.plan.approximated and approx.plan.memory.compressed
    with fxapprox.count_host_syncs() as syncs:
        approx(x).square().mean().backward()
    assert syncs.total == 0, syncs.counts


@pytest.mark.parametrize("method", ["crs", "wta_crs"])
@pytest.mark.parametrize("kind", ["linear forward", "linear backward", "linear weight_grad", "conv2d backward",
                                  "matmul"])
def test_static_random_methods_compile_whole(kind, method):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module, inputs = _case(kind, method)
    compiled = torch.compile(_loss, backend="aot_eager", fullgraph=True)
    compiled(module, *inputs).backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
    torch._dynamo.reset()


def _char_transformer():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from char_transformer import CharTransformer

    tokens = torch.randint(0, 50, (4, 32))
    return CharTransformer(50, 64, 2, 2, 32), (tokens,)


MODELS = {
    "mlp": lambda: (nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)),
                    (torch.randn(32, 64),)),
    "resnet18": lambda: (__import__("torchvision").models.resnet18(num_classes=10), (torch.randn(2, 3, 32, 32),)),
    "char transformer": _char_transformer,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_default_plan_compiles_whole_forward_and_backward(name):
    """The default measured plan of a numeric budget (spent: layers are sampled) of an MLP, a ResNet-18 and the
    char transformer under ``torch.compile(fullgraph=True)``, forward and backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    approx = fxapprox.approximate(model, 0.5, example_inputs=inputs,
                                  config=fxapprox.ApproxConfig(check_every=None, min_gain=None, min_speedup=None,
                                                               min_channels=8))
    assert approx.plan.approximated
    assert {d.method for d in approx.plan.approximated} <= set(STATIC_METHODS)
    compiled = torch.compile(lambda *x: approx(*x).float().square().mean(), backend="aot_eager", fullgraph=True)
    compiled(*inputs).backward()
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters() if p.grad is not None)
    torch._dynamo.reset()
