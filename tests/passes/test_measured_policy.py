"""The measured policy: candidate errors and speed, least-error allocation, the tolerance, the op-kind registry."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig, LayerOverride, Plan
from fxapprox.op_kinds.registry import OP_KINDS, OpKind, register_op_kind
from fxapprox.passes import (annotate_channels, count_flops, enumerate_candidates, measure_candidates,
                             propagate_shapes, trace)
from fxapprox.pipeline.records import CANDIDATES_KEY, candidates_of

#: deterministic plans: no timing (min_speedup=None), no tolerance unless a test sets one
MEASURED = dict(policy="measured", min_speedup=None, max_grad_error=None, min_gain=None)


class TwoBranches(nn.Module):
    """Two equally expensive layers: ``skewed`` sees a few strong input columns, ``flat`` sees even ones."""

    def __init__(self) -> None:
        super().__init__()
        self.skewed = nn.Linear(64, 64)
        self.flat = nn.Linear(64, 64)
        self.register_buffer("column_scale", torch.logspace(-3, 1, 64))

    def forward(self, x):
        return self.skewed(x * self.column_scale) + self.flat(x)


class MLP(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _analysed(model, x, method="topk", **config):
    config = ApproxConfig(**{**MEASURED, **config})
    gm = trace(model)
    count_flops(gm, x)
    propagate_shapes(gm, x)
    annotate_channels(gm)
    enumerate_candidates(gm, method, config)
    return gm, config


def _candidates(gm, name):
    return candidates_of(gm.graph.find_nodes(op="call_module", target=name)[0]).candidates


def test_error_is_zero_at_keep_ratio_one_and_grows_as_the_ratio_falls():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    gm, config = _analysed(MLP(), x, keep_ratios=(0.25, 0.5, 0.75))
    node = gm.graph.find_nodes(op="call_module", target="fc2")[0]
    layer = candidates_of(node)
    full = dataclasses.replace(layer.candidates[0], keep_ratio=1.0, k=128, n=128, blocked=None)  # k = n: exact
    node.meta[CANDIDATES_KEY] = dataclasses.replace(layer, candidates=layer.candidates + (full,))
    measure_candidates(gm, x, config=config)
    candidates = _candidates(gm, "fc2")
    assert candidates[-1].errors == {"output": 0.0, "input_grad": 0.0, "weight_grad": 0.0}
    for mode, quantity in (("forward", "output"), ("backward", "input_grad"), ("weight_grad", "weight_grad")):
        errors = [c.errors[quantity] for c in candidates if c.mode == mode and c.keep_ratio < 1]
        assert len(errors) == 3 and errors[0] > errors[1] > errors[2] > 0, (mode, errors)
    weight_grad = [c for c in candidates if c.mode == "weight_grad" and c.keep_ratio < 1]
    assert all(c.errors["output"] == 0.0 and c.errors["input_grad"] == 0.0 for c in weight_grad)


def test_allocator_prefers_the_layer_whose_columns_are_skewed():
    torch.manual_seed(0)
    approx = fxapprox.approximate(TwoBranches(), 0.8, example_inputs=(torch.randn(128, 64),),
                                  config=ApproxConfig(**MEASURED, mode="forward"))
    plan = approx.plan
    assert plan.budget_met
    assert plan.decision("skewed").approximate and not plan.decision("flat").approximate
    assert "not needed" in plan.decision("flat").reason
    skewed = plan.decision("skewed")
    assert skewed.measured_errors["output"] < 0.1 and skewed.predicted_error is not None
    flat_errors = [c["errors"]["output"] for c in plan.decision("flat").candidates if c["keep_ratio"] == 0.5]
    assert min(flat_errors) > 5 * skewed.measured_errors["output"]


def test_a_budget_is_spent_past_the_tolerance_with_a_warning_and_auto_stays_within_it():
    torch.manual_seed(0)
    x, model = torch.randn(64, 64), MLP()
    free = fxapprox.approximate(model, 0.6, example_inputs=(x,), config=ApproxConfig(**MEASURED)).plan
    assert free.budget_met and free.predicted_error > 0.05 and not free.warnings
    capped = fxapprox.approximate(model, 0.6, example_inputs=(x,),
                                  config=ApproxConfig(**{**MEASURED, "max_grad_error": 0.05})).plan
    # the number is an instruction: the tolerance chooses how, it does not stop short of the budget
    assert capped.budget_met and capped.achieved <= 0.6 + 1e-9
    assert capped.predicted_error > 0.05
    assert any("max_grad_error=0.05" in w and "spent as asked" in w for w in capped.warnings)
    # budget="auto" never passes the tolerance: every layer it refuses says so
    auto = fxapprox.approximate(model, "auto", example_inputs=(x,),
                                config=ApproxConfig(**{**MEASURED, "max_grad_error": 0.05, "min_gain": 1e-6})).plan
    assert auto.predicted_error <= 0.05 + 1e-9 and not auto.warnings


def test_predicted_error_adds_in_squares_and_round_trips():
    torch.manual_seed(0)
    approx = fxapprox.approximate(MLP(), 0.6, example_inputs=(torch.randn(64, 64),), config=ApproxConfig(**MEASURED))
    plan = approx.plan
    assert plan.predicted_error == pytest.approx(math.sqrt(sum(d.predicted_error ** 2 for d in plan.layers)))
    assert all(d.predicted_error == 0.0 for d in plan.layers if not d.approximate and d.op_kind == "linear")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.predicted_error == plan.predicted_error
    assert "model-gradient error" in str(approx.report)
    text = approx.report.text(verbose=True)
    assert "every layer" in text and all(d.target in text for d in plan.layers)


def test_narrow_outputs_block_input_gradient_sampling():
    torch.manual_seed(0)
    gm, _ = _analysed(MLP(), torch.randn(64, 64))
    head = _candidates(gm, "head")
    backward = [c for c in head if c.mode == "backward"]
    assert backward and all("over 10 outputs < min_channels=16" in c.blocked for c in backward)
    assert all(c.blocked is None for c in head if c.mode == "weight_grad")


def test_head_forward_error_is_neither_discounted_nor_averaged():
    from fxapprox.passes.measurement.error_model import FORWARD_DISCOUNT, output_layers
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    # plan_check off: the predictions as the error model makes them, not scaled by the plan's check
    approx = fxapprox.approximate(MLP(), 0.6, example_inputs=(x,), config=ApproxConfig(**MEASURED, plan_check=False))
    assert {"head"} <= output_layers(approx) and not {"fc1", "fc2"} & output_layers(approx)
    owners = 3
    # the head's output error is the loss's: neither discounted nor averaged over the parameterised nodes
    for name, scale in (("head", 1.0 * owners), ("fc2", FORWARD_DISCOUNT)):
        forward = [c for c in approx.plan.decision(name).candidates if c["mode"] == "forward" and "bias" in c]
        assert forward
        for c in forward:
            output = c["bias"]["output"] ** 2 + c["noise"]["output"] ** 2
            assert c["predicted_error"] == pytest.approx(math.sqrt(scale * output / owners)), name


def test_timing_orders_candidates_and_is_recorded():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    config = ApproxConfig(policy="measured", min_speedup=1000.0, measure_repeats=1, timing_cache=False)
    plan = fxapprox.approximate(MLP(), 0.6, example_inputs=(x,), config=config).plan
    # nothing is 1000x faster: a numeric budget still executes its FLOPs, on candidates measured slower, and warns
    assert plan.budget_met and plan.approximated
    assert any("measured slower than min_speedup=1000" in w for w in plan.warnings)
    assert all("measured slower than min_speedup" in d.reason for d in plan.approximated)
    for name in ("fc1", "fc2", "head"):
        decision = plan.decision(name)
        timed = [c for c in decision.candidates if c["blocked"] is None]
        assert timed and all(c["speedup"] > 0 and c["seconds"] > 0 for c in timed)
    # "auto" never takes a candidate slower than min_speedup
    auto = fxapprox.approximate(MLP(), "auto", example_inputs=(x,), config=config).plan
    assert not auto.approximated
    assert all("no candidate measured faster than exact" in d.reason for d in auto.layers if d.op_kind == "linear")


def test_plans_without_timing_are_reproducible():
    x = torch.randn(64, 64)
    plans = []
    for _ in range(2):
        torch.manual_seed(0)
        plans.append(fxapprox.approximate(MLP(), 0.6, example_inputs=(x,), method="wta_crs",
                                          config=ApproxConfig(**MEASURED)).plan)
    assert plans[0] == plans[1]


def test_auto_method_measures_several_methods_and_pinned_overrides():
    torch.manual_seed(0)
    config = ApproxConfig(**MEASURED, overrides=(LayerOverride("fc1", keep_ratio=0.5, mode="weight_grad"),))
    plan = fxapprox.approximate(MLP(), 0.7, example_inputs=(torch.randn(64, 64),), method="auto", config=config).plan
    fc2_methods = {c["method"] for c in plan.decision("fc2").candidates}
    assert {"topk", "wta_crs"} <= fc2_methods
    fc1 = plan.decision("fc1")
    assert fc1.approximate and fc1.mode == "weight_grad" and fc1.keep_ratio == 0.5 and "pinned" in fc1.reason


def test_measurement_leaves_the_model_alone():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    approx = fxapprox.approximate(model, 0.6, example_inputs=(torch.randn(64, 64),), config=ApproxConfig(**MEASURED))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in approx.parameters())
    approx.eval()
    torch.testing.assert_close(approx(torch.ones(3, 64)), model.eval()(torch.ones(3, 64)))


def test_backward_mode_mlp_learns_where_it_diverged():
    """Backward sampling sampled the 10-class head's input gradient over 2 of its 10 outputs; it now stays exact."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(40, 128, 64, generator=g)
    ys = xs[..., :10].argmax(-1)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in zip(xs, ys):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            return F.cross_entropy(model(xs[:8].flatten(0, 1)), ys[:8].flatten()).item()

    torch.manual_seed(0)
    base = MLP(256)
    exact = train(fxapprox.approximate(base, 1.0, example_inputs=(xs[0],)))
    for policy in ("flops", "measured"):
        config = ApproxConfig(policy=policy, mode="backward", min_speedup=None, max_grad_error=None, min_gain=None)
        approx = fxapprox.approximate(base, 0.75, example_inputs=(xs[0],), method="wta_crs", config=config)
        assert not approx.plan.decision("head").approximate
        assert approx.plan.approximated
        loss = train(approx)
        assert loss < 2.0 and loss < exact * 1.25, (policy, loss, exact)


def test_registry_has_one_handler_per_kind():
    assert set(OP_KINDS) == {"linear", "conv2d", "linear_fn", "conv2d_fn", "matmul", "lstm", "conv1d_hf"}
    with pytest.raises(ValueError, match="already registered"):
        register_op_kind(OP_KINDS["linear"])
    with pytest.raises(TypeError, match="OpKind"):
        register_op_kind(object())

    class Unnamed(OpKind):
        pass
    with pytest.raises(TypeError, match="name"):
        register_op_kind(Unnamed())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(policy="greedy"), ValueError, "policy"),
    (dict(keep_ratios=(0.5, 1.0)), ValueError, "keep_ratios"),
    (dict(keep_ratios=0.5), TypeError, "keep_ratios"),
    (dict(max_grad_error=0), ValueError, "max_grad_error"),
    (dict(min_speedup="fast"), TypeError, "min_speedup"),
    (dict(measure_repeats=0), ValueError, "measure_repeats"),
    (dict(noise_horizon=0.5), ValueError, "noise_horizon"),
    (dict(mode="sideways"), ValueError, "mode"),
])
def test_measured_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        ApproxConfig(**kwargs)


def test_old_policy_name_still_works():
    with pytest.warns(DeprecationWarning, match="flops"):
        assert ApproxConfig(policy="budget").policy == "flops"
