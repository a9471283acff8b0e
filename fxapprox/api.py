"""``fxapprox.approximate``: trace → analyse → rank → plan → rewrite → report.

Each stage is a pass in ``fxapprox.passes``; this module only strings them
together and wraps the result in :class:`ApproxGraphModule` (a traced model) or, where torch.fx cannot trace the
model's own code, in its own class with regions (:mod:`fxapprox.pipeline.eager`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx
from torch import nn

from fxapprox._validate import check_choice, check_fraction
from fxapprox.config import ApproxConfig
from fxapprox.errors import TraceError
from fxapprox.ops.sampling import METHODS
from fxapprox.passes.analysis.rank import rank_layers
from fxapprox.passes.capture.regions import hidden_layers, hidden_layers_root, untraceable_root
from fxapprox.passes.capture.trace import EXACT_EVAL_KEY, UNTRACED_KEY, trace_both_modes
from fxapprox.passes.capture.training_flags import follow_training_mode
from fxapprox.passes.measurement.candidates import enumerate_candidates
from fxapprox.passes.measurement.measure_candidates import measure_candidates
from fxapprox.passes.memory.rewrite_saved import remove_saved_markers, rewrite_saved_activations
from fxapprox.passes.policy.budget_policy import AUTO_BUDGET
from fxapprox.passes.rewrite import rewrite_sampled_ops
from fxapprox.pipeline.analysis import analyse, measurement_sandbox
from fxapprox.pipeline.compute_plan import make_compute_plan
from fxapprox.pipeline.eager import approximate_eager
from fxapprox.pipeline.memory_planning import choose_memory_plan, memory_planned, plan_saved_activations
from fxapprox.pipeline.row_planning import forward_sampling_harmless, make_row_plan, row_planned
from fxapprox.passes.analysis.row_blocks import find_row_blocks, row_blocks_of
from fxapprox.passes.measurement.measure_rows import traced_block_runs
from fxapprox.plan import Plan
from fxapprox.report import Report
from fxapprox.runtime.graph_pickle import reduce_graph_module
from fxapprox.runtime.model import ApproxRuntime, _shapes
from fxapprox.runtime.model_state import ExactEval, ModelState


class ApproxGraphModule(ApproxRuntime, torch.fx.GraphModule):
    """The module :func:`approximate` returns: a ``GraphModule`` that trains approximately.

    ``eval()`` computes exactly what the original model computes; ``state_dict()``
    has the original keys.
    """

    def recompile(self):
        # the generated forward, behind the evaluation dispatch (runtime/model_state.py's ExactEval): installed on
        # every (re)compile, copies and unpickled models included, and inert where there is no evaluation graph
        code = super().recompile()
        type(self).forward = ExactEval.dispatching_forward(type(self).forward)
        return code

    def _fxapprox_setup(self, *, budget: float, memory_budget: float | None, method: str, config: ApproxConfig,
                        model_name: str) -> None:
        self._fxapprox_state = ModelState(budget=budget, memory_budget=memory_budget, method=method,
                                             config=config, model_name=model_name)

    # -- planning ---------------------------------------------------------
    def _positional_inputs(self, args: tuple, kwargs: dict) -> tuple:
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        values = list(args)
        for node in placeholders[len(args):]:
            if node.target in kwargs:
                values.append(kwargs[node.target])
            elif node.args:
                values.append(node.args[0])  # the traced default
            else:
                raise TypeError(f"missing input {node.target!r} for planning")
        return tuple(values)

    def plan_from(self, *args, **kwargs) -> Plan:
        """Analyse, plan and rewrite using these inputs (done once; the first batch does it lazily)."""
        state = self._fxapprox_state
        if state.plan is not None:
            raise RuntimeError("this module is already planned; call fxapprox.approximate again to re-plan")
        inputs = self._positional_inputs(args, kwargs)
        config: ApproxConfig = state.config
        analyse(self, inputs, progress=config.progress)
        rank_layers(self)
        enumerate_candidates(self, state.method, config)
        plan, why_not_rows = None, None
        if row_planned(state, config):
            with measurement_sandbox(self):
                has_blocks = bool(find_row_blocks(self))
                if has_blocks:
                    why_not_rows = forward_sampling_harmless(lambda: self.forward(*inputs), state, config)
                if has_blocks and why_not_rows is None:
                    runs, unrunnable = traced_block_runs(self, inputs)
                    plan, why_not_rows = make_row_plan(self, state, config, runs, unrunnable)
        if plan is None:
            if config.policy == "measured" and (state.budget == AUTO_BUDGET or state.budget < 1.0):
                with measurement_sandbox(self):
                    measure_candidates(self, *inputs, config=config, progress=config.progress)
            plan = make_compute_plan(self, inputs, state, config)
            if why_not_rows and row_blocks_of(self):
                plan = dataclasses.replace(plan, note=f"{plan.note}; row sampling not used: {why_not_rows}")
        untraced = tuple(u.to_dict() for u in self.meta.get(UNTRACED_KEY, ()))
        if untraced:
            plan = dataclasses.replace(plan, untraced=untraced)
        rewrite_sampled_ops(self, plan)
        forward = (lambda: self.forward(*inputs))
        if plan.rows is not None:
            state.plan = plan
            forward = (lambda: self._row_call(lambda: self.forward(*inputs)))
        with measurement_sandbox(self):
            plan = self._measure_planned_step(plan, inputs, forward)
        if memory_planned(state.memory_budget, config):
            plan = plan_saved_activations(self, inputs, plan, state, config, checkpoint_blocks=True)
        plan = self._with_schedule(plan)
        state.plan = plan
        state.report = Report(plan, state.model_name, _shapes(inputs), state.history)
        self.set_approximate(state.enabled)
        return plan

    def replan_memory(self, *args, **kwargs) -> Plan:
        """Choose the saved activations' widths again, measured on these inputs and the current weights.

        The plan is made on the first batch, at the weights the model has then; as a model trains, the
        values' sensitivities move (attention's inputs grow costlier, ``benchmarks/bench_planner.py``,
        "attention"). This re-measures every value's cost, solves the same budget again and re-marks the
        graph, as GACT adapts its bits during training. ``ApproxConfig(activation_replan_every=N)`` does it
        every ``N`` training steps on that step's batch. Returns the updated plan.

        Example::

            >>> approx = fxapprox.approximate(model, 1.0, memory_budget=0.125, example_inputs=(x,))
            >>> ...  # train a while
            >>> approx.replan_memory(x).memory.note
        """
        state = self._fxapprox_state
        plan = self.plan
        if plan.memory is None:
            raise RuntimeError("replan_memory needs a memory plan: approximate the model with memory_budget < 1 "
                               "(activation_bits plans choose no widths)")
        inputs = self._positional_inputs(args, kwargs)
        remove_saved_markers(self)
        memory_plan = choose_memory_plan(self, inputs, state.memory_budget, state.memory_config,
                                         checkpoint_blocks=True)
        rewrite_saved_activations(self, memory_plan)
        plan = dataclasses.replace(plan, memory=memory_plan)
        state.plan = plan
        state.report = Report(plan, state.model_name, _shapes(inputs), state.history)
        state.replans = state.replans + 1
        return plan

    def __deepcopy__(self, memo):
        check = self._fxapprox_state.check
        if check is not None:   # the check in flight holds the batch and hooks of this module's tensors
            memo[id(check)] = None
        result = super().__deepcopy__(memo)
        result._fxapprox_state = copy.deepcopy(self._portable_state(), memo)
        return result

    def __reduce__(self):
        # the graph as records (fxapprox/runtime/graph_pickle.py): GraphModule's own pickling re-traces its code
        body = self.__dict__.copy()
        body["_fxapprox_state"] = self._portable_state()
        return reduce_graph_module(self, body)


def _as_inputs(example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword ones."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError(f"example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
                    f"got {type(example_inputs).__name__}")


def approximate(model: nn.Module, budget: float | str = "auto", *, example_inputs=None,
                memory_budget: float | None = None, method: str = "auto",
                config: ApproxConfig | None = None) -> nn.Module:
    """Return a copy of ``model`` whose training step executes ``budget`` of the exact FLOPs.

    ``budget`` is the fraction, in (0, 1], of the exact model's training-step FLOPs (forward + backward) the
    result executes; 1.0 is exact. A number is an instruction: the measured policy spends it whenever the
    model's layers can be sampled that far, choosing which layers, modes, methods and keep-ratios cost least
    (predicted extra training steps per second saved); where they cannot, the plan says which layers cannot be
    sampled and the lowest fraction reachable. The pay-off model advises: the report says what the plan is
    predicted to gain, and warns when the prediction is poor. ``budget="auto"`` (the default) asks it to decide:
    the plan predicted to reach a given loss soonest, exact when none is predicted to beat exact training by
    ``min_gain``. With ``example_inputs`` (a tensor, a tuple of positional inputs or a dict of keyword inputs)
    the model is analysed and planned at once; otherwise on the first batch it sees. ``model`` is never
    modified; it may be an ``nn.Module`` or an already traced ``torch.fx.GraphModule``.

    The result is an :class:`ApproxGraphModule` when torch.fx traces the model
    whole. Where the model's own code does not trace (Hugging Face models on
    transformers 5), or a submodule holding approximable layers does not (a block
    with data-dependent control flow), it is a copy of the model of its own class,
    captured region by region (:mod:`fxapprox.pipeline.eager`: traced children, approximable
    layers swapped in place, the rest run eagerly and exactly), with the same
    ``.plan``, ``.report``, ``.history`` and ``.set_approximate``;
    ``ApproxConfig(strict_trace=True)`` raises :class:`fxapprox.TraceError`
    instead, and a submodule named in ``leaf_modules`` stays whole and exact.

    Example::

        >>> model = torchvision.models.resnet18()
        >>> approx = fxapprox.approximate(model, budget=0.5, example_inputs=(torch.randn(8, 3, 64, 64),))
        >>> approx.report.show()
        >>> torchvision.models.resnet18().load_state_dict(approx.state_dict())
        >>> llm = fxapprox.approximate(LlamaForCausalLM(config), 0.5, example_inputs={"input_ids": ids, "labels": ids})
    """
    if budget != AUTO_BUDGET:
        budget = check_fraction("budget", budget)
    memory_budget = check_fraction("memory_budget", memory_budget, allow_none=True)
    check_choice("method", method, set(METHODS) | {"auto"})
    if config is None:
        config = ApproxConfig()
    elif not isinstance(config, ApproxConfig):
        raise TypeError(f"config must be an fxapprox.ApproxConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a torch.fx.GraphModule, got {type(model).__name__}")
    args, kwargs = ((), {}) if example_inputs is None else _as_inputs(example_inputs)
    model_name = type(model).__name__ if not isinstance(model, torch.fx.GraphModule) else \
        getattr(model, "_fxapprox_model_name", type(model).__name__)
    try:
        traced, counterpart = trace_both_modes(model, config.leaf_modules, strict=config.strict_trace,
                                               torch_transformers=True)
    except TraceError as error:
        if config.strict_trace or error.module_path != "<root>":
            raise
        # The model's own code does not trace: it runs eagerly and its children are captured (fxapprox.pipeline.eager).
        approx = approximate_eager(model, untraceable_root(model, error), budget=budget, memory_budget=memory_budget,
                                   method=method, config=config, model_name=model_name)
        if example_inputs is not None:
            approx.plan_from(*args, **kwargs)
        return approx
    hidden = [] if isinstance(model, torch.fx.GraphModule) or config.strict_trace else \
        hidden_layers(model, traced, config.leaf_modules)
    if hidden:
        # Submodules that do not trace (or that a model library asks fx not to trace into) hold approximable
        # layers: captured like an untraceable root (the model's own code eager, every child traced where it
        # traces, its layers swapped in place) so that the budget reaches them.
        approx = approximate_eager(model, hidden_layers_root(model, hidden), budget=budget, memory_budget=memory_budget,
                                   method=method, config=config, model_name=model_name,
                                   untraced=tuple(hidden) + tuple(u for u in traced.meta[UNTRACED_KEY]
                                                                  if u not in hidden))
        if example_inputs is not None:
            approx.plan_from(*args, **kwargs)
        return approx
    traced = follow_training_mode(traced, counterpart, training=model.training)
    if EXACT_EVAL_KEY in traced.meta:   # the evaluation graph's own traced flags (F.dropout(training=...)) too
        follow_training_mode(traced.meta[EXACT_EVAL_KEY], None if counterpart is None else
                             counterpart.meta.get(EXACT_EVAL_KEY), training=model.training)
    approx = ApproxGraphModule(traced, traced.graph, class_name=model_name)
    approx.meta.update(traced.meta)
    approx.training = model.training
    approx._fxapprox_setup(budget=budget, memory_budget=memory_budget, method=method, config=config,
                           model_name=model_name)
    exact_eval = approx.meta.pop(EXACT_EVAL_KEY, None)
    if exact_eval is not None:
        approx._fxapprox_state.exact_eval = ExactEval(exact_eval)
    if example_inputs is not None:
        approx.plan_from(*args, **kwargs)
    return approx


__all__ = ["ApproxGraphModule", "analyse", "approximate", "measurement_sandbox"]

