"""Compressed activation saving end to end: exact forward, faithful gradients, shared copies, edge cases."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig
from fxapprox.saved_activations import compress_saved, count_saved_bytes


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x)), inplace=True))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(self.drop(torch.flatten(x, 1)))


def _config(**kwargs):
    kwargs.setdefault("activation_compile", False)
    kwargs.setdefault("activation_min_bytes", 0)
    kwargs.setdefault("policy", "flops")
    return ApproxConfig(**kwargs)


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    out = model(x)
    F.cross_entropy(out, y).backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))


def test_memory_budget_one_changes_nothing(batch):
    x, y = batch
    model = SmallCNN()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, memory_budget=1.0, example_inputs=(x,))
    assert approx.plan.memory is None
    assert not any(n.target is compress_saved for n in approx.graph.nodes)
    out, grads = _grads(approx, x, y)
    ref_out, ref = _grads(model, x, y)
    assert torch.equal(out, ref_out)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], atol=1e-5, rtol=0)


def test_32_bits_through_the_hooks_equals_exact(batch):
    x, y = batch
    model = SmallCNN()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=32))
    assert any(n.target is compress_saved for n in approx.graph.nodes)
    out, grads = _grads(approx, x, y)
    ref_out, ref = _grads(model, x, y)
    assert torch.equal(out, ref_out)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits, min_cosine", [(8, 0.99), (4, 0.95)])
def test_gradient_fidelity(batch, bits, min_cosine):
    x, y = batch
    model = SmallCNN()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=bits))
    torch.manual_seed(1)
    out, grads = _grads(approx, x, y)
    ref_out, ref = _grads(model, x, y)
    assert torch.equal(out, ref_out), "the forward must stay exact"
    cosines = {name: F.cosine_similarity(grads[name].flatten(), ref[name].flatten(), dim=0).item() for name in ref}
    assert min(cosines.values()) >= min_cosine, cosines
    stats = approx.saved_activation_stats
    assert stats.packed_tensors > 0 and stats.ratio > (3.5 if bits == 8 else 6.0)


def test_compression_ratio_counts_distinct_tensors(batch):
    x, y = batch
    model = SmallCNN()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=4))
    approx.set_approximate(False)
    with count_saved_bytes(approx) as counter:
        approx(x).sum().backward()
    approx.set_approximate(True)
    approx(x).sum().backward()
    stats = approx.saved_activation_stats
    assert stats.exact_bytes == counter.bytes == approx.plan.memory.total_exact_bytes
    assert stats.stored_bytes == approx.plan.memory.total_planned_bytes


def test_a_tensor_saved_twice_is_packed_once():
    class Square(nn.Module):
        def forward(self, x):
            return (x * x).sum()

    x = torch.randn(64, 64, requires_grad=True)
    approx = fxapprox.approximate(Square(), budget=1.0, example_inputs=(x,), config=_config(activation_bits=8))
    approx(x).backward()
    stats = approx.saved_activation_stats
    assert stats.packed_tensors == 1 and stats.exact_bytes == x.numel() * 4
    torch.testing.assert_close(x.grad, 2 * x.detach(), atol=0.05, rtol=0.02)


def test_retain_graph_and_double_backward(batch):
    x, _ = batch
    approx = fxapprox.approximate(SmallCNN(), budget=1.0, example_inputs=(x,), config=_config(activation_bits=4))
    loss = approx(x).square().sum()
    first = torch.autograd.grad(loss, approx.conv1.weight, retain_graph=True)[0]
    second = torch.autograd.grad(loss, approx.conv1.weight, retain_graph=True)[0]
    torch.testing.assert_close(first, second)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, approx.conv1.weight, create_graph=True)


def test_eval_and_no_grad_do_not_compress(batch):
    x, _ = batch
    model = SmallCNN().eval()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=2))
    approx.eval()
    with torch.no_grad():
        assert torch.equal(approx(x), model(x))
    assert approx.saved_activation_stats is None
    approx.train().set_approximate(False)
    approx(x).sum().backward()
    assert approx.saved_activation_stats is None


def test_dropout_masks_are_bit_packed(batch):
    x, y = batch
    approx = fxapprox.approximate(SmallCNN(dropout=0.5), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=8))
    approx(x).sum().backward()
    plan = approx.plan.memory
    assert plan.internal_bytes > 0
    assert approx.saved_activation_stats.stored_bytes == plan.total_planned_bytes


def test_composes_with_sampled_layers(batch):
    x, y = batch
    approx = fxapprox.approximate(SmallCNN(), budget=0.6, memory_budget=0.2, example_inputs=(x,),
                                  config=_config(min_channels=8))
    assert approx.plan.approximated, "some layer must be sampled for this test"
    compressed = [v for v in approx.plan.memory.values if v.exact_bytes and v.compressed]
    assert compressed
    # The gathered columns a sampled layer saves are attributed to (and compressed with) their source.
    derived = {node.name: node.meta["fxapprox"]["saved_derived"] for node in approx.graph.nodes
               if node.meta.get("fxapprox", {}).get("saved_derived")}
    assert derived
    _, grads = _grads(approx, x, y)
    assert all(torch.isfinite(g).all() for g in grads.values())
    stats = approx.saved_activation_stats
    assert stats.stored_bytes <= 0.2 * stats.exact_bytes * 1.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).to(dtype)
    x = torch.randn(256, 64, dtype=dtype)
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, memory_budget=0.5, example_inputs=(x,),
                                  config=_config())
    approx(x).float().sum().backward()
    assert all(torch.isfinite(p.grad.float()).all() and p.grad.dtype == dtype for p in approx.parameters())
    assert approx.plan.memory.budget_met
    assert approx.saved_activation_stats.stored_bytes <= 0.5 * approx.saved_activation_stats.exact_bytes


def test_channels_last_inputs(batch):
    x, y = batch
    model = SmallCNN().to(memory_format=torch.channels_last)
    xc = x.to(memory_format=torch.channels_last)
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(xc,),
                                  config=_config(activation_bits=8))
    _, grads = _grads(approx, xc, y)
    _, ref = _grads(model, xc, y)
    for name in ref:
        assert F.cosine_similarity(grads[name].flatten(), ref[name].flatten(), dim=0) > 0.99


def test_state_dict_keys_and_compact_max_pool_are_exact(batch):
    x, y = batch
    model = SmallCNN()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=8))
    assert set(approx.state_dict()) == set(model.state_dict())
    SmallCNN().load_state_dict(approx.state_dict())
    assert any(getattr(n.target, "__name__", "") == "compact_max_pool2d" for n in approx.graph.nodes)
