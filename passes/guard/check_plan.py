"""Pass 4e — the plan checked on the example batch, before training: its real errors, and a re-plan where the
predictions fell short.

The measured policy predicts a plan's errors from each layer measured alone, adding in squares. Inside the whole
model they can be far larger: a backward-sampled layer samples its input gradient, and through a stack of such
layers the noise compounds (a ResNet-18 at budget 0.5, every conv backward-sampled at keep 0.25: predicted
model-gradient error 0.46, measured 150 — a gradient that is noise). The guard would see it at step
``check_every``; this pass looks before the first step, on the example batch, as the guard does: the planning
graph runs with every planned node replaced by its approximate op (an ``Interpreter``), against the exact graph,
forward and backward of the projection loss, the same RNG state, sampled draws isolated
(``fxapprox.ops.training_context``); where both families are sampled, a third pass with only the forward-sampled
layers separates them. :func:`~fxapprox.passes.guard.replan.calibration` turns the measurements into measured ÷
predicted factors per family.

The factors are used **conservatively**, only where the model shows more error than predicted (a factor below 1 is
left at 1): the plan is made again with every candidate's predicted error and extra steps scaled by its family's
factor, so the budget goes to the layers and modes whose errors stay where they were predicted. Where the model
shows less (forward sampling's output error usually shrinks through the layers above), the predictions stay as
they were: the pay-off model's costs were fitted with them, and a plan made bolder on one batch is what the guard
could not take back. The check runs again on the new plan, up to :data:`ROUNDS` times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx

from fxapprox.op_kinds.registry import handler_for
from fxapprox.ops.lstm import LSTMBackward
from fxapprox.ops.training_context import training_context
from fxapprox.passes.guard.replan import Calibration, calibrated_error, calibration, predicted_families
from fxapprox.pipeline._projection import first_tensor, projection_loss
from fxapprox.runtime.guard import gradient_errors, owner_groups
from fxapprox.runtime.modules import SamplingSpec

__all__ = ["PlanCheck", "ROUNDS", "check_plan", "tightened"]

#: checks (and re-plans) at most: the plan, and a re-plan with the measured factors, checked again
ROUNDS = 3
#: a family's measured ÷ predicted (squared) past this many times what the plan already assumed re-plans
_MISS = 1.5


@dataclass(frozen=True)
class PlanCheck:
    """What the example batch showed of a plan: the one-step errors the guard measures, beside the predictions."""

    model_error: float
    backward_error: float
    output_error: float
    predicted_backward_error: float
    predicted_output_error: float
    #: measured ÷ predicted per family (squared; ``fxapprox.passes.guard.replan.Calibration``)
    factors: Calibration
    #: the plan's effective model-gradient error (noise averaged over ``noise_horizon`` steps) with each family's
    #: predictions scaled by its factor: what the guard compares with ``max_grad_error`` and ``divergence_error``
    calibrated_error: float

    def to_dict(self) -> dict:
        return {"model_error": self.model_error, "backward_error": self.backward_error,
                "output_error": self.output_error, "predicted_backward_error": self.predicted_backward_error,
                "predicted_output_error": self.predicted_output_error,
                "factors": dataclasses.asdict(self.factors), "calibrated_error": self.calibrated_error}


class _Substituted(torch.fx.Interpreter):
    """Runs the graph with the named nodes computed by the given callables."""

    def __init__(self, gm: torch.fx.GraphModule, calls: dict) -> None:
        super().__init__(gm)
        self.calls = calls

    def run_node(self, n: torch.fx.Node):
        call = self.calls.get(n.name)
        if call is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return call(*args, **kwargs)


def check_plan(gm: torch.fx.GraphModule, plan, inputs: tuple, lstm: LSTMBackward, mean=None) -> PlanCheck | None:
    """Measure ``plan`` (made on ``gm``, before its rewrite) on ``inputs``; ``None`` when nothing is sampled or the
    graph holds no trainable weight (PEFT's frozen base layers, whose adapters run in eager code).

    Run it in the analysis sandbox (``fxapprox.pipeline.analysis.measurement_sandbox``). ``mean(values) -> values``
    averages the three measurements over ranks (``fxapprox.pipeline.ranks.mean_over_ranks``), so that every rank
    re-plans alike.
    """
    sampled = plan.approximated
    if not sampled:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}
    calls, forward_calls = {}, {}
    for decision in sampled:
        node = nodes[decision.node]
        spec = SamplingSpec(method=decision.method, k=decision.k, n=decision.n, mode=decision.mode,
                            random_share=decision.random_share)
        calls[node.name] = handler_for(node).approximate_call(gm, node, spec, lstm)
        if decision.mode == "forward":
            forward_calls[node.name] = calls[node.name]
    params = {name: p for name, p in gm.named_parameters() if p.requires_grad}
    if not params:   # no trainable weight in the graph (frozen layers with adapters run in eager code): no gradient
        return None
    state = torch.get_rng_state()

    def run(substituted: dict):
        torch.set_rng_state(state)   # the same dropout masks; the sampled ops draw from a fork
        with training_context(isolate_draws=True), torch.enable_grad():
            output = _Substituted(gm, substituted).run(*inputs)
            grads = torch.autograd.grad(projection_loss(output), list(params.values()), allow_unused=True)
        return first_tensor(output).detach(), {n: None if g is None else g.detach() for n, g in zip(params, grads)}

    exact_output, exact = run({})
    approx_output, approx = run(calls)
    groups = owner_groups(exact)
    model_error = gradient_errors(exact, approx, groups)[0]
    norm = float(exact_output.double().norm())
    output_error = float((approx_output.double() - exact_output.double()).norm()) / norm if norm else 0.0
    if not forward_calls:
        backward_error = model_error
    elif len(forward_calls) == len(calls):
        backward_error = 0.0
    else:
        backward_error = gradient_errors(run(forward_calls)[1], approx, groups)[0]
    torch.set_rng_state(state)
    if mean is not None:
        model_error, backward_error, output_error = mean([model_error, backward_error, output_error])
    families = predicted_families(gm)
    factors = calibration(families, backward_error, output_error, 0.0, model_error)
    return PlanCheck(model_error=model_error, backward_error=backward_error, output_error=output_error,
                     predicted_backward_error=math.sqrt(families["backward_step"]),
                     predicted_output_error=math.sqrt(families["output"]), factors=factors,
                     calibrated_error=calibrated_error(families, factors))


def tightened(current: Calibration | None, check: PlanCheck) -> Calibration | None:
    """The calibration to re-plan with after ``check``: each family's factor raised to what the check measured
    where that is more than :data:`_MISS` times what the plan assumed (``current``), never lowered below it nor
    below 1; ``None`` when no family missed (the plan stands)."""
    current = current or Calibration(1.0, 1.0, 1.0)
    measured = check.factors
    raised = Calibration(*(max(old, new) if new > _MISS * old else old
                           for old, new in ((current.backward, measured.backward), (current.forward, measured.forward),
                                            (current.output, measured.output))))
    return raised if raised != current else None
