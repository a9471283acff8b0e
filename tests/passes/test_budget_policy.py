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
    """The FLOP-ranked policy (``policy="flops"``); the measured policy has its own tests."""
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
