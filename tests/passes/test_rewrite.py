import operator

import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.pipeline.records import decision_of, flops_of, kind_of
from fxapprox.runtime.modules import ApproxConv2d, ApproxFunctionalLinear, ApproxLinear, ApproxMatmul


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding="same")
        self.fc = nn.Linear(32, 64)
        self.w = nn.Parameter(torch.randn(48, 64) / 8)
        self.v = nn.Parameter(torch.randn(48, 40) / 8)
        self.u = nn.Parameter(torch.randn(24, 40) / 8)

    def forward(self, x):
        h = self.fc(self.conv(x).mean((2, 3)))
        h = F.linear(h, self.w)
        h = h @ self.v
        return operator.matmul(self.u, h.t())


def test_rewrite_replaces_exactly_the_planned_nodes():
    config = fxapprox.ApproxConfig(policy="flops", keep_ratio=0.5, min_channels=8)
    approx = fxapprox.approximate(Mixed(), 0.3, example_inputs=(torch.randn(4, 32, 6, 6),), config=config)
    plan = approx.plan
    assert {d.node for d in plan.approximated} == {"conv", "fc", "linear", "matmul", "matmul_1"}
    assert type(approx.conv) is ApproxConv2d and type(approx.fc) is ApproxLinear
    calls = {n.name: (n.op, n.target) for n in approx.graph.nodes}
    assert calls["linear"] == ("call_module", "fxapprox_linear")
    assert isinstance(approx.fxapprox_linear, ApproxFunctionalLinear)
    assert approx.fxapprox_matmul.parameter_side == "right"
    assert approx.fxapprox_matmul_1.parameter_side == "left"
    assert isinstance(approx.fxapprox_matmul_1, ApproxMatmul)
    assert approx.conv.fxapprox_spec.k == plan.decision("conv").k
    assert approx.conv.weight is approx.get_parameter("conv.weight")
    assert "fxapprox_linear" in approx.code
    # parameter-free wrappers add no state
    assert list(approx.state_dict()) == list(Mixed().state_dict())


def test_node_meta_carries_the_plan():
    approx = fxapprox.approximate(Mixed(), 0.5, example_inputs=(torch.randn(4, 32, 6, 6),),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=8))
    node = next(n for n in approx.graph.nodes if n.name == "fc")
    decision = decision_of(node).decision
    assert decision.approximate and decision.k == approx.fc.fxapprox_spec.k
    assert flops_of(node).forward > 0 and kind_of(node).op_kind == "linear"


def test_eval_and_exact_switch_equal_original_for_mixed_model():
    model = Mixed()
    x = torch.randn(4, 32, 6, 6)
    approx = fxapprox.approximate(model, 0.3, example_inputs=(x,),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=8))
    approx.set_approximate(False)
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)
    approx.set_approximate(True)
    assert not torch.allclose(approx(x), model(x))
    approx.eval()
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)
