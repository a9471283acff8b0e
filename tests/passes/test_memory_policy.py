"""Memory policy, saved-bytes sources and the memory rewrites, on tiny models defined here."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig
from fxapprox.ops.pooling import compact_max_pool2d
from fxapprox.passes.analysis.saved_bytes import measure_saved_bytes
from fxapprox.passes.analysis.shape_prop import propagate_shapes
from fxapprox.passes.memory.compact_pooling import compact_max_pools
from fxapprox.passes.memory.memory_policy import plan_memory
from fxapprox.pipeline.records import BIT_ERRORS_KEY, saved_of
from fxapprox.runtime.saved_markers import compress_saved


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 32, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))


def _analysed(model, x):
    gm = torch.fx.symbolic_trace(model)
    propagate_shapes(gm, x)
    return measure_saved_bytes(gm, x)


def _config(**kwargs):
    kwargs.setdefault("activation_min_bytes", 0)
    kwargs.setdefault("activation_compile", False)
    return ApproxConfig(**kwargs)


def test_saved_bytes_names_sources_and_aliases():
    gm = _analysed(Block(), torch.randn(2, 8, 16, 16))
    nodes = {n.name: saved_of(n) for n in gm.graph.nodes}
    value_bytes = 2 * 32 * 16 * 16 * 4
    assert nodes["bn"].saved_from == {"conv1": value_bytes}
    assert nodes["relu"].alias_of == "bn" and nodes["relu"].inplace
    assert nodes["relu"].saved_from == {"bn": value_bytes}   # relu_ saves its result: bn's storage
    assert nodes["conv2"].saved_from == {"relu": value_bytes}
    assert nodes["relu_1"].saved_from == {"relu_1": value_bytes}  # its own output
    assert nodes["bn"].internal_bytes > 0                         # batch statistics


def test_one_value_behind_in_place_aliases_and_a_sign_mask():
    gm = _analysed(Block(), torch.randn(2, 8, 16, 16))
    plan = plan_memory(gm, 0.25, _config())
    by_node = {v.node: v for v in plan.values}
    assert "relu" not in by_node and by_node["bn"].aliases == ["relu"]
    assert sorted(by_node["bn"].savers) == ["conv2", "relu"] and by_node["bn"].sign_exact
    # relu_1's result is saved only by relu_1 itself (mean saves nothing): a 1-bit mask.
    assert by_node["relu_1"].bits == 1 and by_node["relu_1"].sign_exact is False
    assert plan.total_planned_bytes <= 0.25 * plan.total_exact_bytes
    assert plan.budget_met


@pytest.mark.parametrize("budget", [0.3, 0.2, 0.14, 0.12])   # 0.113: every value at its lowest width
def test_budget_lowers_widths_evenly(budget):
    gm = _analysed(Block(), torch.randn(4, 8, 32, 32))
    plan = plan_memory(gm, budget, _config())
    # 1-bit masks are lossless, not part of the trade; BatchNorm's input has its 8-bit floor
    floored = [v for v in plan.compressed if "no fewer than 8 bits" in v.reason]
    assert floored and all(v.bits == 8 and v.savers == ["bn"] for v in floored)
    widths = {v.bits for v in plan.compressed if v.bits > 1 and v not in floored}
    assert max(widths) <= 2 * min(widths), widths         # never 8 bits next to 2
    assert plan.total_planned_bytes <= budget * plan.total_exact_bytes and plan.budget_met


def test_unreachable_budget_is_reported():
    gm = _analysed(Block(), torch.randn(2, 8, 16, 16))
    plan = plan_memory(gm, 0.01, _config())
    assert not plan.budget_met and "NOT met" in plan.note
    assert all(v.bits in (1, 2) or "no fewer than 8 bits" in v.reason for v in plan.values if v.compressed)


def test_small_values_stay_and_uniform_bits_override():
    gm = _analysed(Block(), torch.randn(2, 8, 16, 16))
    plan = plan_memory(gm, None, _config(activation_bits=4, activation_min_bytes=10**9))
    assert not plan.compressed and all("small" in v.reason for v in plan.values)
    plan = plan_memory(gm, None, _config(activation_bits=4))
    assert {v.bits for v in plan.compressed} <= {1, 4}
    assert plan_memory(gm, None, _config()) is None
    assert plan_memory(gm, 1.0, _config()) is None


def test_rewrite_inserts_markers_after_the_last_alias():
    x = torch.randn(2, 8, 16, 16)
    approx = fxapprox.approximate(Block(), budget=1.0, example_inputs=(x,), config=_config(activation_bits=4))
    markers = [n for n in approx.graph.nodes if n.target is compress_saved]
    # conv2's output is never saved (relu_1 saves its own result); mean is saved by the head
    assert {m.args[0].name for m in markers} == {"x", "conv1", "relu", "relu_1", "mean"}
    relu_marker = next(m for m in markers if m.args[0].name == "relu")
    assert relu_marker.prev.name == "relu" and relu_marker.args[2] is True
    approx.graph.eliminate_dead_code()
    assert len([n for n in approx.graph.nodes if n.target is compress_saved]) == len(markers)


def test_plan_round_trip_and_report_columns():
    x = torch.randn(2, 8, 16, 16)
    approx = fxapprox.approximate(Block(), budget=1.0, memory_budget=0.25, example_inputs=(x,), config=_config())
    assert fxapprox.Plan.from_dict(approx.plan.to_dict()) == approx.plan
    text = approx.report.text(verbose=True)
    for column in ("saved activations", "exact MiB", "bits", "planned MiB", "total"):
        assert column in text
    assert "saved activations" in str(approx.report)   # the summary's memory line
    assert approx.report.to_dict()["memory"]["total_exact_bytes"] == approx.plan.memory.total_exact_bytes


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(3, 2, 1, False), (2, None, 0, False),
                                                                 (3, 2, 1, True), ((3, 2), (1, 2), (1, 0), False)])
def test_compact_max_pool_equals_max_pool(kernel, stride, padding, ceil_mode):
    x = torch.randn(2, 3, 11, 13, requires_grad=True)
    expected = F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode)
    got = compact_max_pool2d(x, kernel, stride, padding, ceil_mode)
    assert torch.equal(expected, got)
    grad = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(expected, x, grad)[0],
                               atol=1e-6, rtol=0)


def test_compact_max_pool_rewrite_and_its_saved_bytes():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.MaxPool2d(3, 2, 1), nn.Flatten())
    x = torch.randn(2, 3, 16, 16)
    gm = _analysed(model, x)
    before = saved_of(next(n for n in gm.graph.nodes if n.target == "1")).internal_bytes
    compact_max_pools(gm)
    pool = next(n for n in gm.graph.nodes if n.target is compact_max_pool2d)
    measure_saved_bytes(gm, x)
    after = saved_of(pool).internal_bytes
    assert after * 8 == before  # int64 indices → uint8 offsets
    torch.testing.assert_close(gm(x), model(x))


def test_config_validation_names_the_argument():
    with pytest.raises(ValueError, match="activation_bits"):
        ApproxConfig(policy="flops", activation_bits=3)
    with pytest.raises(ValueError, match="activation_group_size"):
        ApproxConfig(policy="flops", activation_group_size=100)
    with pytest.raises(ValueError, match="activation_rounding"):
        ApproxConfig(policy="flops", activation_rounding="up")
    with pytest.raises(TypeError, match="activation_compile"):
        ApproxConfig(policy="flops", activation_compile="yes")
    with pytest.raises(ValueError, match="memory_budget"):
        fxapprox.approximate(Block(), memory_budget=1.5)


class FunctionalPool(nn.Module):
    def forward(self, x):
        return F.max_pool2d(torch.relu(x), 2)   # kernel size positional: traced as (x, 2) plus kwargs


def test_functional_max_pool_with_positional_kernel_is_compacted():
    gm = compact_max_pools(torch.fx.symbolic_trace(FunctionalPool()))
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert compact_max_pool2d in targets
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    torch.testing.assert_close(gm(x), FunctionalPool()(x))


class TwoInputs(nn.Module):
    """Two equally wide saved values: the input of ``a`` is Gaussian, that of ``b`` mostly one constant."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 64), nn.Linear(256, 64)

    def forward(self, x, y):
        return self.a(torch.tanh(x)) + self.b(torch.tanh(y))


def test_measured_widths_follow_each_value_s_gradient_cost():
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    y = torch.where(torch.rand(256, 256) < 0.97, torch.full((256, 256), 0.5), torch.randn(256, 256))
    measured = fxapprox.approximate(TwoInputs(), 1.0, memory_budget=0.1, example_inputs=(x, y),
                                    config=_config(activation_min_bytes=1024)).plan.memory
    assert measured.predicted_error is not None and measured.budget_met
    values = {v.node: v for v in measured.values if v.compressed}
    costs = {name: v.predicted_error for name, v in values.items()}
    assert all(c is not None and c >= 0 for c in costs.values())
    # the cheaper value per byte goes lower: widths ordered like the measured costs at equal width
    bits = {name: v.bits for name, v in values.items()}
    assert len(set(bits.values())) > 1, bits
    cheap, dear = sorted(bits, key=bits.get)[0], sorted(bits, key=bits.get)[-1]
    assert "least gradient error per byte" in values[cheap].reason
    width = fxapprox.approximate(TwoInputs(), 1.0, memory_budget=0.1, example_inputs=(x, y),
                                 config=_config(activation_min_bytes=1024, activation_policy="width")).plan.memory
    assert width.predicted_error is None and all(v.predicted_error is None for v in width.values)
    meta = {n.name: n.meta.get(BIT_ERRORS_KEY) for n in
            fxapprox.approximate(TwoInputs(), 1.0, memory_budget=0.1, example_inputs=(x, y),
                                 config=_config(activation_min_bytes=1024)).graph.nodes}
    assert meta[cheap][2]["contribution"] < meta[dear][2]["contribution"]
    assert meta[cheap][8]["contribution"] < meta[cheap][4]["contribution"] < meta[cheap][2]["contribution"]


class Attention(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("policy", ["measured", "width"])
def test_attention_inputs_keep_eight_bits(policy):
    torch.manual_seed(0)
    approx = fxapprox.approximate(Attention(), 1.0, memory_budget=0.15, example_inputs=(torch.randn(4, 32, 64),),
                                  config=_config(activation_policy=policy))
    values = approx.plan.memory.values
    attention_inputs = [v for v in values if any(s.startswith("scaled_dot_product_attention") for s in v.savers)
                        and not v.node.startswith("scaled_dot_product_attention")]
    assert attention_inputs and all(v.bits == 8 and "no fewer than 8 bits" in v.reason for v in attention_inputs)
    assert any(v.bits < 8 for v in values if v.compressed and v not in attention_inputs)


@pytest.mark.parametrize("policy", ["measured", "width"])
def test_batch_norm_inputs_keep_eight_bits(policy):
    """BatchNorm's backward divides by each channel's batch deviation: its saved input keeps 8 bits however low
    the budget (2-bit copies made ResNet-18's gradients explode within 14 steps), the other values go lower."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    approx = fxapprox.approximate(model, 1.0, memory_budget=0.05, example_inputs=(torch.randn(8, 3, 16, 16),),
                                  config=_config(activation_policy=policy, activation_min_bytes=1024))
    values = approx.plan.memory.values
    norm_inputs = [v for v in values if v.savers == ["_1"]]   # the BatchNorm2d is node _1
    assert norm_inputs and all(v.bits == 8 and "batch deviation" in v.reason for v in norm_inputs)
    assert any(v.bits < 8 for v in values if v.compressed and v not in norm_inputs)
