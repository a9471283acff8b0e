import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import fxapprox

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


def _step_flops(module, x, labels):
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(module(x), labels).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name, budget_must_be_met", [("resnet18", True), ("resnet50", True),
                                                      ("mobilenet_v3_small", False)])
def test_torchvision_model_end_to_end(name, budget_must_be_met):
    model = torchvision.models.get_model(name, weights=None, num_classes=10)
    x, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    approx = fxapprox.approximate(model, 0.5, example_inputs=(x,), config=FLOPS)
    plan = approx.plan
    if budget_must_be_met:
        assert plan.budget_met, plan.note
    # eval is exact
    model.eval(), approx.eval()
    torch.testing.assert_close(approx(x), model(x), rtol=0, atol=0)
    # weights load back into the original architecture
    torchvision.models.get_model(name, weights=None, num_classes=10).load_state_dict(approx.state_dict())
    # the executed training FLOPs are what the plan says
    approx.train()
    measured = _step_flops(approx, x, labels)
    assert math.isclose(measured, plan.total_planned_flops, rel_tol=0.03)
    if plan.budget_met:
        assert measured <= 0.5 * plan.total_exact_flops * 1.02
    assert all(torch.isfinite(p.grad).all() for p in approx.parameters() if p.grad is not None)
    if name == "mobilenet_v3_small":
        reasons = " ".join(d.reason for d in plan.layers if not d.approximate)
        assert "depthwise" in reasons
