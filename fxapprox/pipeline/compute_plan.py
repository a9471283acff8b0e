"""The compute plan as :func:`fxapprox.approximate` makes it, for a traced model and a region-captured one alike:
the budget policy (``passes/policy/budget_policy.py``), what forward-sampled layers keep of their inputs
(``passes/policy/input_saving.py``), one plan for every rank (``fxapprox/pipeline/ranks.py``), and the plan's check
on the example batch with the re-plans it asks for (``passes/guard/check_plan.py``).
"""

from __future__ import annotations

import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.ops.lstm import LSTMBackward
from fxapprox.passes.guard.check_plan import ROUNDS, check_plan, tightened
from fxapprox.passes.policy.budget_policy import plan_budget
from fxapprox.passes.policy.input_saving import plan_input_saving
from fxapprox.pipeline.analysis import measurement_sandbox
from fxapprox.pipeline.ranks import agreed_plan, mean_over_ranks
from fxapprox.plan import Plan
from fxapprox.runtime.model_state import ModelState

__all__ = ["make_compute_plan"]


def make_compute_plan(gm: torch.fx.GraphModule, inputs: tuple, state: ModelState, config: ApproxConfig) -> Plan:
    """The plan for ``gm`` (analysed, ranked, candidates measured) on the example ``inputs``.

    With the measured policy and ``config.plan_check``, the plan is run on the example batch against exact
    training, and made again with the measured errors where they passed the predictions (up to
    ``passes.check_plan.ROUNDS`` checks); the plan records its last check.
    """
    def plan_with(calibration) -> Plan:
        plan = plan_budget(gm, state.budget, state.method, config, calibration=calibration)
        return agreed_plan(gm, plan_input_saving(gm, plan), state)

    plan = plan_with(None)
    if config.policy != "measured" or not config.plan_check:
        return plan
    lstm = LSTMBackward(config.lstm_granularity, config.lstm_block_steps)
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    calibration, check, replans = None, None, 0
    for round_index in range(ROUNDS):
        with measurement_sandbox(gm):
            check = check_plan(gm, plan, inputs, lstm, mean=lambda values: mean_over_ranks(values, device))
        raised = None if check is None else tightened(calibration, check)
        if raised is None or round_index == ROUNDS - 1:
            break
        calibration, replans = raised, replans + 1
        plan = plan_with(calibration)
    return plan if check is None else plan.with_check(check, calibration, replans)
