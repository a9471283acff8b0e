import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxapprox
from fxapprox.runtime.modules import ApproxConv2d, ApproxLinear

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.conv = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(self.conv(x))
        return self.fc(x.mean((2, 3)))


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(96, 64) / 8)
        self.b1 = nn.Parameter(torch.zeros(96))
        self.w2 = nn.Parameter(torch.randn(96, 48) / 8)
        self.w3 = nn.Parameter(torch.randn(32, 48) / 8)

    def forward(self, x):
        h = F.linear(x, self.w1, self.b1)
        h = torch.relu(h) @ self.w2            # parameter on the right
        return (self.w3 @ h.t()).t()          # parameter on the left


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.out(y)


def _train_flops(module, *inputs):
    with FlopCounterMode(display=False) as counter:
        out = module(*inputs)
        out.float().pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("factory, shape", [(MLP, (32, 64)), (CNN, (4, 3, 16, 16)), (Functional, (32, 64))])
def test_eval_matches_original_and_state_dict_keys(factory, shape):
    model = factory()
    x = torch.randn(shape)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    assert list(approx.state_dict()) == list(model.state_dict())
    model.eval(), approx.eval()
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)


def test_train_approximated_deploy_exact():
    model = CNN()
    x = torch.randn(8, 3, 16, 16)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    opt = torch.optim.SGD(approx.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(approx(x), torch.randint(0, 10, (8,))).backward()
        opt.step()
    fresh = CNN()
    fresh.load_state_dict(approx.state_dict())
    fresh.eval(), approx.eval()
    torch.testing.assert_close(fresh(x), approx(x), rtol=0, atol=0)


def test_input_model_is_not_mutated():
    model = CNN()
    before = copy.deepcopy(model.state_dict())
    children = {name: type(m) for name, m in model.named_modules()}
    approx = fxapprox.approximate(model, 0.5, example_inputs=(torch.randn(4, 3, 16, 16),), config=FLOPS)
    assert {name: type(m) for name, m in model.named_modules()} == children
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # BN running stats untouched by the analysis
    approx.train()
    approx(torch.randn(4, 3, 16, 16)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert any(isinstance(m, (ApproxLinear, ApproxConv2d)) for m in approx.modules())


def test_analysis_leaves_buffers_and_rng_alone():
    model = CNN()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(torch.randn(4, 3, 16, 16),), config=FLOPS)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(approx.bn.running_mean, model.bn.running_mean)
    assert int(approx.bn.num_batches_tracked) == 0


def test_lazy_planning_on_first_batch():
    approx = fxapprox.approximate(MLP(), 0.5, config=FLOPS)
    assert not approx.planned
    with pytest.raises(fxapprox.PlanNotReadyError, match="first batch"):
        approx.report
    out = approx(torch.randn(16, 64))
    assert out.shape == (16, 10)
    assert approx.planned and approx.report.plan.budget_met
    assert approx.report.input_shapes == [[16, 64]]
    # the very first batch already ran the planned (sampled) graph
    assert isinstance(approx.fc2, ApproxLinear)


def test_lazy_planning_with_keyword_input():
    approx = fxapprox.approximate(MLP(), 0.5, config=FLOPS)
    assert approx(x=torch.randn(16, 64)).shape == (16, 10)
    assert approx.planned


@pytest.mark.parametrize("factory, shape", [(MLP, (64, 64)), (CNN, (8, 3, 16, 16)), (Functional, (64, 64))])
@pytest.mark.parametrize("budget", [0.5, 0.7])
def test_measured_flops_match_plan(factory, shape, budget):
    model = factory()
    x = torch.randn(shape)
    approx = fxapprox.approximate(model, budget, example_inputs=(x,),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=8))
    plan = approx.plan
    assert _train_flops(model, x) == plan.total_exact_flops
    measured = _train_flops(approx, x)
    assert math.isclose(measured, plan.total_planned_flops, rel_tol=0.03)
    if plan.budget_met:
        assert measured <= budget * plan.total_exact_flops * 1.02


def test_set_approximate_switches_to_exact_training():
    model = MLP()
    x = torch.randn(32, 64)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    assert approx.set_approximate(False) is approx
    exact_flops = _train_flops(approx, x)
    assert exact_flops == approx.plan.total_exact_flops
    torch.testing.assert_close(approx(x), model(x))
    approx.set_approximate(True)
    assert _train_flops(approx, x) < exact_flops
    with pytest.raises(TypeError, match="enabled"):
        approx.set_approximate(1)


def test_set_approximate_before_lazy_plan_is_kept():
    approx = fxapprox.approximate(MLP(), 0.5, config=FLOPS).set_approximate(False)
    approx(torch.randn(8, 64))
    assert not approx.fc2.fxapprox_enabled


@pytest.mark.parametrize("bad, error", [
    (True, TypeError), ("0.5", TypeError), (None, TypeError), (float("nan"), ValueError),
    (0, ValueError), (-0.1, ValueError), (1.01, ValueError), (float("inf"), ValueError),
])
def test_bad_budget(bad, error):
    with pytest.raises(error, match=r"budget.*\(0, 1\]"):
        fxapprox.approximate(MLP(), bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="method must be one of"):
        fxapprox.approximate(MLP(), 0.5, method="nope")
    with pytest.raises(TypeError, match="config"):
        fxapprox.approximate(MLP(), 0.5, config={"min_k": 3})
    with pytest.raises(TypeError, match="model"):
        fxapprox.approximate(lambda x: x, 0.5)
    with pytest.raises(ValueError, match="memory_budget"):
        fxapprox.approximate(MLP(), 0.5, memory_budget=0)
    with pytest.raises(TypeError, match="memory_budget"):
        fxapprox.approximate(MLP(), 0.5, memory_budget="8-bit")


def test_budget_one_is_exact():
    model = CNN()
    x = torch.randn(4, 3, 16, 16)
    approx = fxapprox.approximate(model, 1.0, example_inputs=(x,))
    assert not approx.plan.approximated
    assert approx.plan.total_planned_flops == approx.plan.total_exact_flops
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)


def test_graph_module_input_is_used_as_is():
    model = MLP()
    gm = torch.fx.symbolic_trace(model)
    approx = fxapprox.approximate(gm, 0.5, example_inputs=(torch.randn(8, 64),), config=FLOPS)
    assert list(approx.state_dict()) == list(gm.state_dict())
    assert isinstance(gm.fc2, nn.Linear) and not isinstance(gm.fc2, ApproxLinear)


def test_lstm_stays_a_leaf_and_gets_a_sparse_backward():
    model = WithLSTM()
    x = torch.randn(4, 10, 32)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    lstm = approx.plan.decision("lstm")
    assert lstm.approximate and lstm.mode == "backward" and lstm.method == "topk"
    assert lstm.exact_flops > 0  # counted through our registered oneDNN RNN formula
    assert lstm.planned_flops < lstm.exact_flops
    assert type(approx.lstm).__name__ == "ApproxLSTM"
    assert [n.op for n in approx.graph.nodes if n.target == "lstm"] == ["call_module"]


def test_gru_stays_exact_with_reason():
    class WithGRU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(32, 64)

        def forward(self, x):
            return self.gru(x)[0]

    approx = fxapprox.approximate(WithGRU(), 0.5, example_inputs=(torch.randn(10, 4, 32),), config=FLOPS)
    gru = approx.plan.decision("gru")
    assert not gru.approximate and "recurrent" in gru.reason
    assert not approx.plan.budget_met and "not reachable" in approx.plan.note


def test_deepcopy_keeps_plan_and_behaviour():
    x = torch.randn(8, 64)
    approx = fxapprox.approximate(MLP(), 0.5, example_inputs=(x,), config=FLOPS)
    clone = copy.deepcopy(approx)
    assert clone.plan == approx.plan
    clone.eval(), approx.eval()
    torch.testing.assert_close(clone(x), approx(x))


def test_empty_batch_and_half_precision_inputs():
    model = MLP()
    approx = fxapprox.approximate(model, 0.5, example_inputs=(torch.randn(8, 64),), config=FLOPS)
    assert approx(torch.randn(0, 64)).shape == (0, 10)
    half = fxapprox.approximate(MLP().to(torch.bfloat16), 0.5,
                                example_inputs=(torch.randn(8, 64, dtype=torch.bfloat16),), config=FLOPS)
    out = half(torch.randn(8, 64, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
