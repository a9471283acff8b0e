"""Compressed activation saving end to end: exact forward, faithful gradients, shared copies, edge cases."""

import copy
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig
from fxapprox.pipeline.records import saved_of
from fxapprox.runtime.saved_activations import count_saved_bytes
from fxapprox.runtime.saved_markers import compress_saved


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
    derived = {node.name: saved_of(node).saved_derived for node in approx.graph.nodes
               if saved_of(node).saved_derived}
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


class PreNormMLP(nn.Module):
    """LayerNorm → Linear → GELU → Linear: the LayerNorm's and the GELU's outputs can be rebuilt in backward."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def test_recomputed_values_store_nothing_and_are_exact_from_exact_sources():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    model = PreNormMLP()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=32))
    memory = approx.plan.memory
    rebuilt = {v.node: v for v in memory.recomputed}
    assert set(rebuilt) == {"ln", "gelu"}, [(v.node, v.reason) for v in memory.values]
    assert rebuilt["ln"].recomputed_from == "x" and rebuilt["gelu"].recomputed_from == "fc1"
    assert all(v.planned_bytes == 0 and not v.compressed and "recomputed in backward" in v.reason
               for v in rebuilt.values())
    assert fxapprox.plan.MemoryPlan.from_dict(memory.to_dict()) == memory
    _assert_same_training_step(approx, model, x)
    stats = approx.saved_activation_stats
    # what the LayerNorm's and the GELU's outputs took is not kept: only x, fc1's output and small statistics
    assert stats.stored_bytes < stats.exact_bytes - (x.numel() + 4 * x.numel()) * 4 * 0.99


def _assert_same_training_step(approx, model, x):
    """Same output exactly and the same gradients (to fp32 rounding) as the exact model."""
    out, grads = _grads_sum(approx, x)
    ref_out, ref = _grads_sum(model, x)
    assert torch.equal(out, ref_out)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], atol=1e-6, rtol=1e-6)


def _grads_sum(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out ** 2).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_recompute_can_be_turned_off_and_needs_a_saved_source():
    class TanhHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)

        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))   # fc1's output is saved by nobody: tanh keeps its result

    x = torch.randn(64, 32)
    off = fxapprox.approximate(PreNormMLP(), 1.0, memory_budget=0.3, example_inputs=(torch.randn(8, 16, 32),),
                               config=_config(activation_recompute=False)).plan.memory
    assert not off.recomputed
    tanh = fxapprox.approximate(TanhHead(), 1.0, memory_budget=0.3, example_inputs=(x,), config=_config()).plan.memory
    assert not tanh.recomputed


def test_recomputed_from_quantised_sources_tracks_the_measured_error():
    torch.manual_seed(0)
    x = torch.randn(16, 32, 64)
    model = PreNormMLP(64)
    approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.1, example_inputs=(x,),
                                  config=_config(activation_recompute=True))
    memory = approx.plan.memory
    assert memory.budget_met and {v.node for v in memory.recomputed} == {"ln", "gelu"}
    source = next(v for v in memory.values if v.node == "fc1")
    assert source.compressed and source.bits < 32 and source.predicted_error > 0
    errors = []
    for seed in range(3):
        torch.manual_seed(seed)
        _, grads = _grads_sum(approx, x)
        _, ref = _grads_sum(model, x)
        errors.append(math.sqrt(sum(float((grads[n] - ref[n]).square().sum()) for n in ref)
                                / sum(float(ref[n].square().sum()) for n in ref)))
    # the whole model-gradient error, measured, is within a few times what the plan predicted
    assert 0 < statistics.median(errors) < 4 * memory.predicted_error + 1e-3, (errors, memory.predicted_error)


def test_dense_views_of_one_tensor_share_one_copy():
    class Transposed(nn.Module):
        def forward(self, x):
            y = x * 2.0
            return (y.transpose(1, 2) * y).sum()    # saves y and its transpose: two dense views of one tensor

    x = torch.randn(4, 64, 64, requires_grad=True)
    approx = fxapprox.approximate(Transposed(), 1.0, example_inputs=(x,), config=_config(activation_bits=8))
    approx(x).backward()
    stats = approx.saved_activation_stats
    assert stats.packed_tensors == 1, stats
    torch.testing.assert_close(x.grad, 8 * x.detach().transpose(1, 2), atol=0.3, rtol=0.05)


def _attention_inputs(shift: float = 0.0):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    k = k + shift * torch.randn(16)          # a component every key shares, as trained keys have
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(scale=0.3),
                                    dict(attn_mask=torch.randn(32, 32)), dict(attn_mask=torch.rand(32, 32) > 0.2)])
def test_attention_from_saved_inputs_equals_sdpa(kwargs):
    from fxapprox.ops.attention import as_in_compressed_training, attention_from_saved_inputs
    q, k, v = _attention_inputs()
    grad = torch.randn(2, 4, 32, 16)
    reference = F.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    with as_in_compressed_training():
        out = attention_from_saved_inputs(q, k, v, **kwargs)
    assert out.grad_fn is not None and "AttentionFromSavedInputs" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, reference, atol=0, rtol=0)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = attention_from_saved_inputs(q, k, v, **kwargs)    # not compressing: the kernel itself
    assert "AttentionFromSavedInputs" not in type(plain.grad_fn).__name__
    with pytest.raises(ValueError, match="dropout_p"):
        attention_from_saved_inputs(q, k, v, dropout_p=0.1)


def test_rebuilt_attention_normalises_away_a_shared_key_error():
    """Under the same 4-bit copies of q, k, v, re-normalised weights beat the exact forward's log-sum-exp."""
    from torch.autograd.graph import saved_tensors_hooks

    from fxapprox.ops.attention import as_in_compressed_training, attention_from_saved_inputs
    from fxapprox.ops.quantize import quantize

    def unpack(tensor):
        if tensor.dtype != torch.float32 or tensor.dim() != 4 or tensor.shape[-1] != 16:
            return tensor
        return quantize(tensor, 4).dequantize().view(tensor.shape)

    q, k, v = _attention_inputs(shift=6.0)
    grad = torch.randn(2, 4, 32, 16)
    exact = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

    def error(function):
        torch.manual_seed(1)
        with saved_tensors_hooks(lambda t: t, unpack), as_in_compressed_training():
            got = torch.autograd.grad(function(q, k, v, is_causal=True), (q, k, v), grad)
        return math.sqrt(sum(float((g - e).square().sum()) for g, e in zip(got, exact))
                         / sum(float(e.square().sum()) for e in exact))

    plain, rebuilt = error(F.scaled_dot_product_attention), error(attention_from_saved_inputs)
    assert rebuilt < 0.5 * plain, (rebuilt, plain)


def test_recomputed_values_rerun_under_the_forward_s_autocast(monkeypatch):
    import fxapprox.runtime.saved_activations as saved_activations

    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    model = PreNormMLP()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=32))
    assert approx.plan.memory.recomputed
    seen = []

    def gelu(*args, **kwargs):   # what backward's rebuild runs under (CPU autocast leaves GELU's dtype alone)
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return F.gelu(*args, **kwargs)

    monkeypatch.setitem(saved_activations.RECOMPUTABLE_FUNCTIONS, "gelu", gelu)
    results = []
    for module in (approx, model):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().square().sum().backward()
        results.append({name: p.grad.clone() for name, p in module.named_parameters()})
    assert seen == [torch.bfloat16]
    for name, grad in results[1].items():
        torch.testing.assert_close(results[0][name], grad, atol=1e-6, rtol=1e-6)


def test_replan_memory_re_marks_the_graph_on_current_weights():
    from fxapprox.runtime.saved_markers import recompute_saved

    torch.manual_seed(0)
    x = torch.randn(16, 32, 64)
    approx = fxapprox.approximate(PreNormMLP(64), 1.0, memory_budget=0.15, example_inputs=(x,), config=_config())
    before = approx.plan.memory

    def markers():
        return sorted((n.target.__name__, n.args[0].name) for n in approx.graph.nodes
                      if n.target in (compress_saved, recompute_saved))

    expected = markers()
    with torch.no_grad():
        approx.fc1.weight.mul_(3.0)   # the values' sensitivities move with the weights
    after = approx.replan_memory(x).memory
    assert after.budget_met and after.predicted_error != before.predicted_error
    assert markers() == sorted([("compress_saved", v.node) for v in after.compressed]
                               + [("recompute_saved", v.node) for v in after.recomputed])
    assert len(markers()) == len(expected)
    assert approx.report.plan.memory == after
    (approx(x) ** 2).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters())
    with pytest.raises(RuntimeError, match="memory_budget"):
        fxapprox.approximate(PreNormMLP(64), 0.5, example_inputs=(x,), config=_config()).replan_memory(x)


def test_replan_every_n_training_steps():
    torch.manual_seed(0)
    x = torch.randn(16, 32, 64)
    approx = fxapprox.approximate(PreNormMLP(64), 1.0, memory_budget=0.15, example_inputs=(x,),
                                  config=_config(activation_replan_every=2))
    for _ in range(5):
        approx(x).sum().backward()
    with torch.no_grad():
        approx(x)          # no_grad and eval forwards are not training steps
    approx.eval()(x)
    assert approx._fxapprox_state.replans == 2
    with pytest.raises(ValueError, match="activation_replan_every"):
        ApproxConfig(activation_replan_every=0)


def test_chained_rebuild_through_a_linear_is_exact_from_an_exact_source():
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    model = PreNormMLP()
    approx = fxapprox.approximate(copy.deepcopy(model), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=32, activation_recompute="linear"))
    rebuilt = {v.node: v.recomputed_from for v in approx.plan.memory.recomputed}
    assert rebuilt == {"ln": "x", "fc1": "ln", "gelu": "fc1"}, rebuilt
    _assert_same_training_step(approx, model, x)
    stats = approx.saved_activation_stats
    assert stats.stored_bytes < 0.3 * stats.exact_bytes, stats   # x and small statistics only


def test_auto_rebuilds_linear_outputs_only_when_the_budget_needs_them():
    torch.manual_seed(0)
    x = torch.randn(16, 32, 64)
    loose = fxapprox.approximate(PreNormMLP(64), 1.0, memory_budget=0.5, example_inputs=(x,),
                                 config=_config()).plan.memory
    assert {v.node for v in loose.recomputed} == {"ln", "gelu"}
    # x and fc1's output at 8 bits are 0.127 of the exact bytes: below that, fc1's output is rebuilt
    tight = fxapprox.approximate(PreNormMLP(64), 1.0, memory_budget=0.1, example_inputs=(x,),
                                 config=_config()).plan.memory
    assert {v.node for v in tight.recomputed} == {"ln", "fc1", "gelu"}
    assert tight.budget_met and all(v.bits >= 8 for v in tight.values if v.compressed)
    assert "by Linear" in next(v.reason for v in tight.values if v.node == "fc1")
    cheap = fxapprox.approximate(PreNormMLP(64), 1.0, memory_budget=0.1, example_inputs=(x,),
                                 config=_config(activation_recompute=True)).plan.memory
    assert any(v.bits < 8 for v in cheap.values if v.compressed)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="activation_recompute"):
            ApproxConfig(activation_recompute=bad)


@pytest.mark.parametrize("group_size", [64, 256])
def test_plan_and_runtime_agree_on_the_group_size(batch, group_size):
    """The plan costs each group's metadata at ``activation_group_size``, as the packer stores it."""
    x, _ = batch
    approx = fxapprox.approximate(SmallCNN(), budget=1.0, example_inputs=(x,),
                                  config=_config(activation_bits=4, activation_group_size=group_size))
    approx(x).sum().backward()
    assert approx.saved_activation_stats.stored_bytes == approx.plan.memory.total_planned_bytes
