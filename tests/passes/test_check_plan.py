"""The plan checked on the example batch (``passes/guard/check_plan.py``): measured errors, conservative re-plans."""

import pytest
import torch
from torch import nn

import fxapprox
from fxapprox import ApproxConfig
from fxapprox.passes.guard.check_plan import PlanCheck, tightened
from fxapprox.passes.guard.replan import Calibration

#: no timing (plans depend on errors only), no tolerance: the budget is spent as the errors say
UNTIMED = dict(min_speedup=None, max_grad_error=None, check_every=None)
#: error costs under which backward sampling looks cheap (forward sampling 40x the cost per squared error): the
#: plan a compounding stack gets unless the check catches it
BACKWARD_CHEAP = dict(UNTIMED, backward_error_cost=1.0, forward_error_cost=40.0)


def _deep(depth: int = 8, width: int = 64) -> nn.Module:
    """A plain stack (no residual): a sampled input gradient reaches every layer below it."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _check(plan) -> dict:
    assert plan.check is not None
    return plan.check


def _measured_error(approx, x) -> float:
    """One step's model-gradient error of ``approx`` against exact training on ``x`` (the same seed)."""
    from fxapprox.pipeline._projection import projection_loss
    from fxapprox.runtime.guard import gradient_errors, owner_groups

    def grads(sampling: bool) -> dict:
        approx.set_approximate(sampling)
        torch.manual_seed(1)
        params = {n: p for n, p in approx.named_parameters()}
        values = torch.autograd.grad(projection_loss(approx(x)), list(params.values()))
        return dict(zip(params, values))
    exact, sampled = grads(False), grads(True)
    return gradient_errors(exact, sampled, owner_groups(exact))[0]


def test_a_compounding_backward_stack_is_replanned_with_the_measured_errors():
    x = torch.randn(256, 64)
    unchecked = fxapprox.approximate(_deep(), 0.6, example_inputs=(x,),
                                     config=ApproxConfig(plan_check=False, **BACKWARD_CHEAP))
    assert unchecked.plan.check is None
    assert sum(d.mode == "backward" for d in unchecked.plan.approximated) >= 4
    checked = fxapprox.approximate(_deep(), 0.6, example_inputs=(x,), config=ApproxConfig(**BACKWARD_CHEAP))
    check = _check(checked.plan)
    # the noise of each layer's sampled input gradient compounds through the layers below: far more than predicted,
    # so the budget goes to modes whose errors held
    assert check["replans"] >= 1 and check["calibration"]["backward"] > 10
    assert sum(d.mode == "backward" for d in checked.plan.approximated) < \
        sum(d.mode == "backward" for d in unchecked.plan.approximated)
    assert checked.plan.budget_met and checked.plan.achieved <= 0.6 + 1e-9   # the budget is still spent
    assert _measured_error(checked, x) < 0.25 * _measured_error(unchecked, x)
    again = fxapprox.approximate(_deep(), 0.6, example_inputs=(x,), config=ApproxConfig(**BACKWARD_CHEAP))
    assert again.plan.fingerprint() == checked.plan.fingerprint()   # reproducible, the check included


def test_errors_smaller_than_predicted_do_not_make_the_plan_bolder():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    plan = fxapprox.approximate(model, 0.5, example_inputs=(torch.randn(128, 128),),
                                config=ApproxConfig(mode="forward", **UNTIMED)).plan
    check = _check(plan)
    assert check["factors"]["output"] < 1          # the output error shrinks through the layers above ...
    assert check["calibration"] is None or check["calibration"]["output"] == 1.0   # ... and is not used to go further
    assert check["model_error"] > 0 and check["output_error"] > 0


def test_tightened_raises_only_what_missed():
    def check(backward, forward, output):
        return PlanCheck(1.0, 1.0, 1.0, 1.0, 1.0, Calibration(backward, forward, output), 1.0)
    assert tightened(None, check(1.2, 0.5, 0.01)) is None                          # within 1.5x: the plan stands
    assert tightened(None, check(10.0, 0.5, 0.01)) == Calibration(10.0, 1.0, 1.0)   # never below 1
    assert tightened(Calibration(10.0, 1.0, 1.0), check(12.0, 0.5, 0.01)) is None   # what the plan assumed
    assert tightened(Calibration(10.0, 1.0, 1.0), check(40.0, 3.0, 0.01)) == Calibration(40.0, 3.0, 1.0)


def test_the_check_is_recorded_in_the_plan_and_the_report():
    x = torch.randn(256, 64)
    approx = fxapprox.approximate(_deep(4), 0.6, example_inputs=(x,), config=ApproxConfig(**UNTIMED))
    plan = approx.plan
    assert fxapprox.Plan.from_dict(plan.to_dict()) == plan
    assert "checked" in str(approx.report) and f"{plan.check['model_error']:.3g}" in str(approx.report)
