"""Methods, sampling modes, recipes and BN recalibration through fxapprox.approximate."""

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxapprox
from fxapprox import ApproxConfig, LayerOverride

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.stem(x)))
        x = F.relu(self.bn2(self.conv(x)))
        return self.fc(x.mean((2, 3)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _step_flops(module, x):
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(module(x), torch.zeros(x.shape[0], dtype=torch.long)).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("method", ["crs", "bernoulli"])
def test_unbiased_methods_train_and_spend_the_plan(method):
    x = torch.randn(64, 128)
    approx = fxapprox.approximate(MLP(), 0.5, example_inputs=(x,), method=method, config=FLOPS)
    plan = approx.plan
    assert {d.method for d in plan.approximated} == {method}
    flops = [_step_flops(approx, x) for _ in range(20)]
    # both keep k distinct pairs in expectation (CRS draws until it expects k distinct ones)
    assert statistics.mean(flops) == pytest.approx(plan.total_planned_flops, rel=0.1)
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters())


def test_backward_mode_keeps_forward_exact_and_meets_budget():
    model, x = CNN(), torch.randn(16, 3, 12, 12)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), method="topk",   # deterministic FLOPs per step
                                  config=ApproxConfig(policy="flops", mode="backward"))
    plan = approx.plan
    assert plan.budget_met and {d.mode for d in plan.approximated} == {"backward"}
    # the forward is the exact one even in training mode
    model.train(), approx.train()
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)
    # backward FLOPs shrink: the measured step is within a few percent of the plan
    measured = _step_flops(approx, x)
    assert measured == pytest.approx(plan.total_planned_flops, rel=0.05)
    assert measured <= 0.5 * plan.total_exact_flops * 1.02


def test_mode_and_method_overrides_per_layer():
    config = ApproxConfig(policy="flops", overrides=(LayerOverride("fc1", method="bernoulli", mode="backward"),))
    approx = fxapprox.approximate(MLP(), 0.5, example_inputs=(torch.randn(32, 128),), config=config)
    fc1 = approx.plan.decision("fc1")
    assert fc1.method == "bernoulli" and fc1.mode == "backward"
    assert approx.fc1.fxapprox_spec.mode == "backward"
    assert approx.plan.decision("fc2").mode == "forward"


def test_paper_recipe_samples_every_wide_layer_at_the_ratio():
    x = torch.randn(4, 3, 12, 12)
    plan = fxapprox.approximate(CNN(), 0.9, example_inputs=(x,), config=ApproxConfig.paper_recipe(0.5, 64)).plan
    assert {d.node for d in plan.approximated} == {"fc"}
    assert plan.decision("fc").k == 32 and "min_channels=64" in plan.decision("conv").reason
    plan = fxapprox.approximate(CNN(), 0.9, example_inputs=(x,), config=ApproxConfig.paper_recipe(0.5, 16)).plan
    assert {d.node for d in plan.approximated} == {"conv", "fc"}
    assert all(d.keep_ratio == 0.5 for d in plan.approximated)
    assert plan.budget_met and "uniform recipe" in plan.note   # the budget is a cap the recipe stays under
    assert "uniform recipe" in plan.decision("conv").reason
    tight = fxapprox.approximate(CNN(), 0.3, example_inputs=(x,), config=ApproxConfig.paper_recipe(0.5, 16)).plan
    assert tight.achieved == pytest.approx(plan.achieved) and not tight.budget_met
    assert "not reachable" not in tight.note and "budget 0.3 not met" in tight.note


def test_topk_random_share_reaches_the_module_and_pure_topk_is_configurable():
    x = torch.randn(16, 128)
    approx = fxapprox.approximate(MLP(), 0.5, example_inputs=(x,), config=FLOPS)
    assert approx.fc2.fxapprox_spec.random_share == ApproxConfig(policy="flops").random_share > 0
    pure = fxapprox.approximate(MLP(), 0.5, example_inputs=(x,), config=ApproxConfig(policy="flops", random_share=0.0))
    assert pure.fc2.fxapprox_spec.random_share == 0.0
    crs = fxapprox.approximate(MLP(), 0.5, example_inputs=(x,), method="crs", config=FLOPS)
    assert crs.fc2.fxapprox_spec.random_share == 0.0   # unbiased methods do not starve columns


def test_recalibrate_bn_matches_exact_statistics():
    torch.manual_seed(0)
    model = CNN()
    batches = [torch.randn(8, 3, 12, 12) for _ in range(4)]
    approx = fxapprox.approximate(model, 0.5, example_inputs=(batches[0],), config=FLOPS)
    opt = torch.optim.SGD(approx.parameters(), lr=0.05)
    for x in batches:  # approximate training moves BN stats on approximate activations
        opt.zero_grad()
        F.cross_entropy(approx(x), torch.zeros(8, dtype=torch.long)).backward()
        opt.step()
    reference = CNN()
    reference.load_state_dict(approx.state_dict())
    for bn in (reference.bn1, reference.bn2):
        bn.reset_running_stats()
        bn.momentum = None
    with torch.no_grad():
        for x in batches:
            reference(x)
    assert not torch.allclose(approx.bn2.running_var, reference.bn2.running_var)
    used = fxapprox.recalibrate_bn(approx, ((x, torch.zeros(8)) for x in batches))
    assert used == 4
    torch.testing.assert_close(approx.bn2.running_mean, reference.bn2.running_mean)
    torch.testing.assert_close(approx.bn2.running_var, reference.bn2.running_var)
    assert approx.bn2.momentum == 0.1 and approx.training and approx.conv.fxapprox_enabled
    with pytest.raises(ValueError, match="no batches"):
        fxapprox.recalibrate_bn(approx, [])
