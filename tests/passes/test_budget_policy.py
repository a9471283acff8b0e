import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig, LayerOverride, Plan


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.big = nn.Conv2d(32, 128, 3, padding=1)
        self.mid = nn.Conv2d(128, 64, 1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.grouped(self.dw(F.relu(self.stem(x))))
        x = self.mid(F.relu(self.big(x)))
        attn = torch.softmax(x.flatten(2) @ x.flatten(2).transpose(1, 2), -1)  # activation @ activation
        return self.fc((attn @ x.flatten(2)).mean(-1))


X = torch.randn(4, 3, 12, 12)


def _plan(budget=0.5, **config):
    """The FLOP-ranked policy (``policy="flops"``); the measured policy is tested below on injected measurements
    and in test_measured_policy.py on measured ones."""
    config.setdefault("policy", "flops")
    return fxapprox.approximate(Net(), budget, example_inputs=(X,), config=ApproxConfig(**config)).plan


def test_every_exact_layer_has_a_reason():
    plan = _plan()
    reasons = {d.node: d.reason for d in plan.layers if not d.approximate}
    assert "min_channels=16" in reasons["stem"]
    assert "depthwise" in reasons["dw"]
    assert "grouped conv (groups=4)" in reasons["grouped"]
    assert "activations" in reasons["matmul"]
    assert all(reason for reason in reasons.values())


def test_budget_met_and_floor_respected():
    plan = _plan(0.6)
    assert plan.budget_met and plan.achieved <= 0.6 + 1e-9
    for d in plan.approximated:
        assert d.keep_ratio >= 0.1 - 1e-9
        assert d.planned_flops == round(d.exact_flops * d.k / d.n)


def test_loose_budget_spends_on_top_ranked_layers_only():
    plan = _plan(0.85)
    sampled = {d.node for d in plan.approximated}
    assert sampled == {"big"}, sampled
    assert "not needed" in plan.decision("mid").reason
    big = plan.decision("big")
    assert big.keep_ratio >= 0.5  # the preferred ratio, raised so no more is cut than needed
    one_pair = big.exact_flops / big.n / plan.total_exact_flops  # the plan's granularity
    assert plan.budget_met and 0.85 - one_pair <= plan.achieved <= 0.85


def test_unreachable_budget_reports_what_was_achieved():
    plan = _plan(0.05)
    assert not plan.budget_met
    assert "not reachable" in plan.note and f"{plan.achieved:.3f}" in plan.note
    # every sampled layer sits at the floor: ceil(min_keep_ratio * n), but at least min_k pairs
    assert plan.approximated
    assert all(d.k == max(math.ceil(0.1 * d.n), 4) for d in plan.approximated)


def test_overrides_exclude_pin_and_method():
    config = dict(overrides=(LayerOverride("fc", exclude=True), LayerOverride(nn.Conv2d, keep_ratio=0.25)))
    plan = _plan(0.5, **config)
    assert not plan.decision("fc").approximate and "excluded by override 'fc'" in plan.decision("fc").reason
    assert plan.decision("big").k == 8 and "pinned" in plan.decision("big").reason
    assert plan.decision("mid").k == 32
    regex = _plan(0.5, overrides=(LayerOverride(r"m.d", exclude=True),))
    assert "excluded" in regex.decision("mid").reason


def test_min_k_and_min_channels():
    plan = _plan(0.5, min_channels=64)
    assert "min_channels=64" in plan.decision("big").reason
    plan = _plan(0.5, min_k=40)
    assert "min_k=40" in plan.decision("big").reason  # k=16 at keep-ratio 0.5 of 32


def test_plan_round_trips_through_json():
    plan = _plan()
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_budget_one_leaves_everything_exact():
    plan = _plan(1.0)
    assert not plan.approximated and plan.budget_met
    assert all("budget 1.0" in d.reason for d in plan.layers if d.node in {"big", "mid", "fc"})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(keep_ratio=0), ValueError, "keep_ratio"),
    (dict(keep_ratio=0.2, min_keep_ratio=0.3), ValueError, "min_keep_ratio"),
    (dict(min_channels=0), ValueError, "min_channels"),
    (dict(min_k=2.5), TypeError, "min_k"),
    (dict(leaf_modules="fc"), TypeError, "leaf_modules"),
    (dict(overrides=("fc",)), TypeError, "overrides"),
])
def test_config_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        ApproxConfig(**kwargs)


def test_override_validation():
    with pytest.raises(ValueError, match="regular expression"):
        LayerOverride("(")
    with pytest.raises(ValueError, match="keep_ratio"):
        LayerOverride("fc", keep_ratio=1.5)
    with pytest.raises(ValueError, match="exclude"):
        LayerOverride("fc", exclude=True, keep_ratio=0.5)
    with pytest.raises(TypeError, match="pattern"):
        LayerOverride(3)


# -- the measured policy on injected measurements --------------------------------------------------------------
# The measured policy's own phases (least error per FLOP saved, the raised last ratio, the tolerance, min_speedup)
# on candidates whose errors and speed are written in by hand: no measurement noise, every figure known.
class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


MEASURED_BY_HAND = dict(policy="measured", mode="weight_grad", min_speedup=1.05, min_gain=None, min_channels=8,
                        keep_ratios=(0.25, 0.5, 0.75))


def _tower_with_measurements(errors: dict, speedups: dict | None = None, **config):
    """Tower analysed and its candidates enumerated, each candidate then given ``errors[layer] · (1 - keep)`` as
    its weight-gradient error and ``speedups[layer]`` as its speed-up (2.0 by default)."""
    import dataclasses

    from fxapprox.passes import (annotate_channels, count_flops, enumerate_candidates, propagate_shapes,
                                 rank_layers, trace)
    from fxapprox.pipeline.records import CANDIDATES_KEY, candidates_of

    config = ApproxConfig(**{**MEASURED_BY_HAND, **config})
    x = torch.randn(32, 64)
    gm = trace(Tower())
    count_flops(gm, x)
    propagate_shapes(gm, x)
    annotate_channels(gm)
    rank_layers(gm)
    enumerate_candidates(gm, "wta_crs", config)
    for node in gm.graph.find_nodes(op="call_module"):
        layer = candidates_of(node)
        measured = tuple(dataclasses.replace(
            c, errors={"output": 0.0, "input_grad": 0.0, "weight_grad": errors[node.target] * (1 - c.keep_ratio)},
            seconds=1.0 / (speedups or {}).get(node.target, 2.0), speedup=(speedups or {}).get(node.target, 2.0))
            for c in layer.candidates)
        node.meta[CANDIDATES_KEY] = dataclasses.replace(layer, candidates=measured, exact_seconds=1.0)
    return gm, config


def test_measured_policy_samples_the_layer_with_less_error_per_flop_first():
    from fxapprox.passes import plan_budget

    gm, config = _tower_with_measurements({"a": 0.4, "b": 0.1})
    plan = plan_budget(gm, 0.88, "wta_crs", config)
    assert [d.node for d in plan.approximated] == ["b"], plan.note
    assert "least predicted time to a given loss per FLOP saved" in plan.decision("b").reason
    assert "not needed" in plan.decision("a").reason
    assert plan.budget_met and plan.achieved <= 0.88 + 1e-9


def test_measured_policy_raises_the_last_ratio_to_cut_no_more_than_the_budget_needs():
    from fxapprox.passes import plan_budget

    gm, config = _tower_with_measurements({"a": 0.4, "b": 0.1})
    plan = plan_budget(gm, 0.88, "wta_crs", config)
    b = plan.decision("b")
    # off the 0.25/0.5/0.75 grid: the fewest pairs that still meet the budget
    assert b.keep_ratio not in config.keep_ratios and "keep-ratio raised" in b.reason
    exact_total = plan.total_exact_flops
    one_pair_more = b.exact_flops - round((b.exact_flops - b.planned_flops) * (b.n - b.k - 1) / (b.n - b.k))
    assert plan.total_planned_flops <= 0.88 * exact_total + 0.5
    assert plan.total_planned_flops + (one_pair_more - b.planned_flops) > 0.88 * exact_total, \
        "one pair more would miss the budget"
    # the interpolated error lies between the grid points around it
    grid = {c["keep_ratio"]: c["errors"]["weight_grad"] for c in b.candidates}
    below = max(r for r in grid if r < b.keep_ratio)
    above = min((r for r in grid if r > b.keep_ratio), default=1.0)
    assert grid.get(above, 0.0) <= b.measured_errors["weight_grad"] <= grid[below]


def test_measured_policy_spends_the_budget_past_the_tolerance_and_warns():
    from fxapprox.passes import plan_budget

    gm, config = _tower_with_measurements({"a": 2.0, "b": 2.0}, max_grad_error=0.3)
    plan = plan_budget(gm, 0.75, "wta_crs", config)
    assert plan.budget_met and plan.achieved <= 0.75 + 1e-9 and plan.predicted_error > 0.3
    assert len(plan.warnings) == 1 and "max_grad_error=0.3" in plan.warnings[0]


def test_measured_policy_says_which_budget_is_out_of_reach_and_why():
    from fxapprox.passes import plan_budget

    # weight-gradient sampling cuts at most a third of a layer's FLOPs: 0.3 cannot be reached
    gm, config = _tower_with_measurements({"a": 0.1, "b": 0.1})
    plan = plan_budget(gm, 0.3, "wta_crs", config)
    assert not plan.budget_met and plan.lowest_reachable == pytest.approx(plan.achieved)
    assert "budget 0.3 not reachable" in plan.note and "lowest-keep-ratio" not in plan.note
    assert any("not reachable" in w for w in plan.warnings)
    assert all(d.approximate for d in plan.layers)   # every layer at its lowest keep-ratio


def test_measured_policy_takes_slower_candidates_only_where_the_budget_needs_them():
    from fxapprox.passes import plan_budget

    # b is fast and enough for 0.9: a, measured no faster, stays exact
    gm, config = _tower_with_measurements({"a": 0.1, "b": 0.1}, speedups={"a": 1.0})
    plan = plan_budget(gm, 0.9, "wta_crs", config)
    assert not plan.decision("a").approximate and plan.decision("b").approximate
    assert "no candidate measured faster than exact (best 1.00x < min_speedup=1.05)" in plan.decision("a").reason
    assert not plan.warnings
    # 0.8 needs both: a is sampled, and the plan says it was measured slower
    gm, config = _tower_with_measurements({"a": 0.1, "b": 0.1}, speedups={"a": 1.0})
    plan = plan_budget(gm, 0.8, "wta_crs", config)
    assert plan.decision("a").approximate and plan.budget_met
    assert "measured slower than min_speedup" in plan.decision("a").reason
    assert any("measured slower than min_speedup=1.05 (a)" in w for w in plan.warnings)


def test_config_round_trips_through_json_and_rejects_what_it_cannot_rebuild():
    config = ApproxConfig(overrides=(LayerOverride(nn.Linear, keep_ratio=0.25), LayerOverride("fc", exclude=True)),
                          leaf_modules=(nn.GRU, "encoder"), keep_ratios=(0.5, 0.25), check_every=None)
    assert ApproxConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['budgt'\]"):
        ApproxConfig.from_dict({"budgt": 0.5})

    class Local(nn.Module):
        pass
    with pytest.raises(ValueError, match="cannot import the module type"):
        ApproxConfig.from_dict(ApproxConfig(leaf_modules=(Local,)).to_dict())
    with pytest.raises(TypeError):
        ApproxConfig(())   # keyword arguments only: the fields' order is the docs' sections, not an API


def test_payoff_note_says_sooner_or_later_as_a_factor_above_one():
    from fxapprox.passes.policy.payoff import GainModel

    model = GainModel(exact_step_seconds=None, total_flops=100.0)
    # Half the FLOPs saved: 2x faster per step. 1.6x the steps: sooner; 5x the steps: 2.5x later.
    assert model.describe(None, 50.0, 0.6) == "predicted 2.00x faster per step, 1.60x the steps: 1.25x sooner to " \
                                              "the same loss"
    assert model.describe(None, 50.0, 4.0) == "predicted 2.00x faster per step, 5.00x the steps: 2.50x later to " \
                                              "the same loss"
    assert model.describe(None, 50.0, math.inf).endswith("infx the steps: never to the same loss")
