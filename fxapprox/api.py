"""``fxapprox.approximate``: trace → analyse → rank → plan → rewrite → report.

Each stage is a pass in ``fxapprox.passes``; this module only strings them
together and wraps the result in :class:`ApproxGraphModule`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import statistics
import warnings

import torch
import torch.fx
from torch import nn

from fxapprox._validate import check_choice, check_fraction
from fxapprox.config import ApproxConfig
from fxapprox.errors import PlanNotReadyError
from fxapprox.guard import (CheckRecord, CheckStep, LayerCheck, TrainingHistory, alignment_and_cosine, gradient_errors,
                            owner_groups)
from fxapprox.modules import APPROX_MODULE_TYPES, SamplingSpec
from fxapprox.ops.attention import as_in_compressed_training
from fxapprox.ops.sampling import METHODS
from fxapprox.passes._meta import fx_meta
from fxapprox.passes.attention_recompute import recompute_attention
from fxapprox.passes.budget_policy import AUTO_BUDGET, gain_model, plan_budget
from fxapprox.passes.candidates import enumerate_candidates, parameterised
from fxapprox.passes.channels import annotate_channels
from fxapprox.passes.compact_pooling import compact_max_pools
from fxapprox.passes.flops import count_flops
from fxapprox.passes.input_saving import plan_input_saving
from fxapprox.passes.measure_candidates import measure_candidates
from fxapprox.passes.measure_saved import measure_saved_values
from fxapprox.passes.memory_policy import memory_candidates, plan_memory, resolve_recompute
from fxapprox.passes.rank import rank_layers
from fxapprox.passes.replan import calibrated_error, calibration, predicted_families, replan
from fxapprox.passes.rewrite import rewrite_sampled_ops
from fxapprox.passes.rewrite_saved import rewrite_saved_activations
from fxapprox.passes.saved_bytes import measure_saved_bytes
from fxapprox.passes.shape_prop import propagate_shapes
from fxapprox.passes.trace import UNTRACED_KEY, trace_both_modes
from fxapprox.passes.training_flags import follow_training_mode
from fxapprox.plan import Plan
from fxapprox.report import Report
from fxapprox.saved_activations import (SavedActivationStats, SavingOptions, compress_saved, compressing_saved_tensors,
                                        recompute_saved)


@contextlib.contextmanager
def _measurement_sandbox(gm: torch.fx.GraphModule):
    """Run analysis without side effects: buffers (BN stats), RNG and mode are restored."""
    buffers = {name: buffer.detach().clone() for name, buffer in gm.named_buffers()}
    modes = {module: module.training for module in gm.modules()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        gm.train()
        try:
            yield
        finally:
            for module, mode in modes.items():
                module.training = mode
            with torch.no_grad():
                for name, buffer in gm.named_buffers():
                    buffer.copy_(buffers[name])


def analyse(gm: torch.fx.GraphModule, example_inputs: tuple, progress: bool = False) -> torch.fx.GraphModule:
    """Run every analysis pass on ``gm`` (shapes, FLOPs, saved bytes, channels)."""
    with _measurement_sandbox(gm):
        # The FLOP pass runs first: it reports a model that fails on these inputs
        # as an AnalysisError naming the node (ShapeProp would print a traceback).
        count_flops(gm, *example_inputs, progress=progress)
        propagate_shapes(gm, *example_inputs)
        measure_saved_bytes(gm, *example_inputs, progress=progress)
    annotate_channels(gm)
    return gm


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _shapes(values) -> list:
    return [list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in values]


class ApproxGraphModule(torch.fx.GraphModule):
    """The module :func:`approximate` returns: a ``GraphModule`` that trains approximately.

    ``eval()`` computes exactly what the original model computes; ``state_dict()``
    has the original keys.
    """

    def _fxapprox_setup(self, *, budget: float, memory_budget: float | None, method: str, config: ApproxConfig,
                        model_name: str) -> None:
        self._fxapprox_state = {"budget": budget, "memory_budget": memory_budget, "method": method,
                                "config": config, "model_name": model_name, "plan": None, "report": None,
                                "enabled": True, "saving": None, "saved_stats": None, "training_steps": 0,
                                "history": TrainingHistory(), "check": None, "in_reference": False}

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
        if state["plan"] is not None:
            raise RuntimeError("this module is already planned; call fxapprox.approximate again to re-plan")
        inputs = self._positional_inputs(args, kwargs)
        config: ApproxConfig = state["config"]
        analyse(self, inputs, progress=config.progress)
        rank_layers(self)
        enumerate_candidates(self, state["method"], config)
        if config.policy == "measured" and (state["budget"] == AUTO_BUDGET or state["budget"] < 1.0):
            with _measurement_sandbox(self):
                measure_candidates(self, *inputs, config=config, progress=config.progress)
        plan = plan_input_saving(self, plan_budget(self, state["budget"], state["method"], config))
        untraced = tuple(u.to_dict() for u in self.meta.get(UNTRACED_KEY, ()))
        if untraced:
            plan = dataclasses.replace(plan, untraced=untraced)
        rewrite_sampled_ops(self, plan)
        memory_budget = state["memory_budget"]
        if config.activation_bits is not None or (memory_budget is not None and memory_budget < 1.0):
            compact_max_pools(self)
            recompute_attention(self)
            # Sampled layers save gathered copies and max pools byte offsets now: measure the rewritten graph.
            with _measurement_sandbox(self), as_in_compressed_training():
                measure_saved_bytes(self, *inputs, progress=config.progress)
                memory_config = state["memory_config"] = resolve_recompute(self, memory_budget, config)
                if config.activation_policy == "measured" and config.activation_bits is None:
                    measure_saved_values(self, *inputs, values=memory_candidates(self, memory_config),
                                         config=memory_config, progress=config.progress)
            memory_plan = plan_memory(self, memory_budget, memory_config)
            rewrite_saved_activations(self, memory_plan)
            plan = dataclasses.replace(plan, memory=memory_plan)
            state["saving"] = SavingOptions(config.activation_group_size, config.activation_rounding,
                                            config.activation_compile)
        state["plan"] = plan
        state["report"] = Report(plan, state["model_name"], _shapes(inputs), state["history"])
        self.set_approximate(state["enabled"])
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
        config: ApproxConfig = state["config"]
        inputs = self._positional_inputs(args, kwargs)
        markers = [n for n in self.graph.nodes if n.target in (compress_saved, recompute_saved)]
        modules = {arg for n in markers if n.target is recompute_saved for arg in n.args[2:3]
                   if isinstance(arg, torch.fx.Node)}
        for node in markers:
            self.graph.erase_node(node)
        for node in modules:
            if not node.users:
                self.graph.erase_node(node)
        self.recompile()
        config = state["memory_config"]
        with _measurement_sandbox(self), as_in_compressed_training():
            if config.activation_policy == "measured" and config.activation_bits is None:
                measure_saved_values(self, *inputs, values=memory_candidates(self, config), config=config,
                                     progress=config.progress)
        memory_plan = plan_memory(self, state["memory_budget"], config)
        rewrite_saved_activations(self, memory_plan)
        plan = dataclasses.replace(plan, memory=memory_plan)
        state["plan"] = plan
        state["report"] = Report(plan, state["model_name"], _shapes(inputs), state["history"])
        state["replans"] = state.get("replans", 0) + 1
        return plan

    def __call__(self, *args, **kwargs):
        state = self._fxapprox_state
        if state["plan"] is None:
            self.plan_from(*args, **kwargs)
        training = state["enabled"] and self.training and torch.is_grad_enabled()
        if state["in_reference"] or not training:
            return super().__call__(*args, **kwargs)
        if not torch.compiler.is_compiling():
            return self._training_call(args, kwargs)
        if self._check_every() is not None and not state.get("warned_compile"):
            state["warned_compile"] = True
            warnings.warn("fxapprox: the guard (ApproxConfig(check_every=...)) does not run under torch.compile; "
                          "the compiled training step is not checked against exact gradients", RuntimeWarning,
                          stacklevel=2)
        if state["saving"] is None:
            return super().__call__(*args, **kwargs)
        warnings.warn("fxapprox: with a memory plan (memory_budget) the training forward runs eagerly under "
                      "torch.compile (compressed activation saving is not compiled); the sampled ops of a "
                      "compute-only plan compile", RuntimeWarning, stacklevel=2)
        return self._compressing_call(*args, **kwargs)

    def _begin_step(self, args, kwargs) -> int:
        """Count a training step; close a check whose backward never ran; re-plan the memory when due."""
        state = self._fxapprox_state
        check = state["check"]
        if check is not None:
            check.cancel()
            state["check"] = None
        state["training_steps"] += 1
        every = state["config"].activation_replan_every
        if every and state["training_steps"] % every == 0 and state["memory_budget"] is not None \
                and state["saving"] is not None:
            self.replan_memory(*args, **kwargs)
        return state["training_steps"]

    def _training_call(self, args, kwargs):
        state = self._fxapprox_state
        step = self._begin_step(args, kwargs)
        if state["saving"] is not None:
            def call():
                return self._compressed_forward(args, kwargs)
        else:
            def call():
                return super(ApproxGraphModule, self).__call__(*args, **kwargs)
        if not self._check_due(step):
            return call()
        plan = self.plan
        forward = any(d.mode == "forward" for d in plan.approximated)
        backward = any(d.mode != "forward" for d in plan.approximated) or plan.memory is not None
        check = CheckStep(self, args, kwargs, self._reference_call, lambda measured: self._checked(step, measured),
                          replay=forward and backward)
        state["check"] = check
        return check.run(call)

    @torch._dynamo.disable
    def _compressing_call(self, *args, **kwargs):
        # Eager under torch.compile (a graph break here): the pack hooks key saved tensors by storage and the
        # markers tag graph values as they are made, neither of which survives inductor's rewriting of the
        # forward and of what it saves.
        self._begin_step(args, kwargs)
        return self._compressed_forward(args, kwargs)

    def _compressed_forward(self, args, kwargs):
        state = self._fxapprox_state
        with compressing_saved_tensors(state["saving"], self) as compressor:
            output = super().__call__(*args, **kwargs)
        state["saved_stats"] = compressor.stats()
        return output

    # -- the guard ------------------------------------------------------------------------------
    def _check_every(self) -> int | None:
        return self._fxapprox_state["config"].check_every

    def _check_due(self, step: int) -> bool:
        every = self._check_every()
        if every is None or step % every:
            return False
        plan = self.plan
        return bool(plan.approximated) or (plan.memory is not None and bool(plan.memory.compressed
                                                                             or plan.memory.recomputed))

    def _reference_call(self, args, kwargs, aliases, keep_forward: bool = False):
        """The model on ``aliases`` of its parameters, exact (the guard's reference pass) or, with
        ``keep_forward``, with only the forward-sampled layers sampled (no compressed activations either)."""
        state = self._fxapprox_state
        modules = [m for m in self.modules() if isinstance(m, APPROX_MODULE_TYPES)]
        flags = [m.fxapprox_enabled for m in modules]
        for module in modules:
            module.fxapprox_enabled = module.fxapprox_enabled and keep_forward \
                and module.fxapprox_spec.mode == "forward"
        state["in_reference"] = True
        try:
            return torch.func.functional_call(self, aliases, args, kwargs, strict=False)
        finally:
            state["in_reference"] = False
            for module, flag in zip(modules, flags):
                module.fxapprox_enabled = flag

    def _layer_parameters(self, decision) -> list[str]:
        """Names of the parameters an approximated layer's weight gradient is measured on."""
        node = next((n for n in self.graph.nodes if n.name == decision.node), None)
        if node is None:
            return []
        names = []
        if node.op == "call_module":
            module = self.get_submodule(node.target)
            names += [f"{node.target}.{name}" for name, p in module.named_parameters(recurse=False)
                      if p.requires_grad]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and parameterised(self, arg):
                names.append(arg.target)
        return names

    def _checked(self, step: int, measured: dict) -> None:
        """Turn one check's gradients into a :class:`~fxapprox.guard.CheckRecord` and act on it: re-plan when
        the calibrated error passes the tolerance or the plan is no longer predicted to pay."""
        state = self._fxapprox_state
        state["check"] = None
        plan = self.plan
        config: ApproxConfig = state["config"]
        exact, approx, replay = measured["exact"], measured["approx"], measured["replay"]
        groups = owner_groups(exact)
        model_error, _ = gradient_errors(exact, approx, groups)
        forward = any(d.mode == "forward" for d in plan.approximated)
        if replay is not None:
            backward_error = gradient_errors(replay, approx, groups)[0]
        else:
            backward_error = 0.0 if forward else model_error
        families = predicted_families(self)
        memory_error = plan.memory.predicted_error if plan.memory is not None else None
        layers = []
        for decision in plan.approximated:
            names = self._layer_parameters(decision)
            _, errors = gradient_errors(exact, approx, {decision.target: names}) if names else (0.0, {})
            layers.append(LayerCheck(node=decision.node, target=decision.target, method=decision.method,
                                     mode=decision.mode, keep_ratio=decision.keep_ratio,
                                     planned_error=decision.isolated_grad_error,
                                     measured_error=errors.get(decision.target)))
        alignment, cosine = alignment_and_cosine(exact, approx)
        # Under DDP each rank checked its own shard of the batch: every rank acts on the ranks' mean, so all make
        # the same decision and the plans stay in agreement.
        model_error, backward_error, output_error, exact_seconds, approx_seconds = _mean_over_ranks(
            [model_error, backward_error, measured["output_error"], measured["exact_seconds"],
             measured["approx_seconds"]], next(iter(self.parameters())).device)
        factors = calibration(families, backward_error, output_error, memory_error or 0.0, model_error)
        calibrated = math.hypot(calibrated_error(families, factors),
                                math.sqrt(factors.backward) * (memory_error or 0.0))
        record = CheckRecord(step=step, model_error=model_error, predicted_error=plan.predicted_step_error,
                             backward_error=backward_error,
                             predicted_backward_error=math.sqrt(families["backward_step"] + (memory_error or 0) ** 2),
                             output_error=output_error,
                             predicted_output_error=math.sqrt(families["output"]),
                             calibrated_error=calibrated, alignment=alignment, cosine=cosine,
                             exact_seconds=exact_seconds, approx_seconds=approx_seconds,
                             layers=tuple(layers), planned_flops=plan.achieved)
        record = self._act_on_check(record, factors)
        state["history"].append(record)
        if config.check_verbose:
            _console().print(record.line(), highlight=False)

    def _act_on_check(self, record: CheckRecord, factors) -> CheckRecord:
        """Re-plan when the check says the plan costs more than the tolerance or no longer pays; the record
        says what was done and why."""
        state = self._fxapprox_state
        config: ApproxConfig = state["config"]
        plan = self.plan
        payoff = gain_model(self, plan.total_exact_flops, config)
        # Speed: the median of the measured speed-ups since the last re-plan (the first check's step may still pay
        # one-off costs: left out once there are others). Measured values only: under DDP they are the ranks'
        # mean, so every rank decides alike.
        since = []
        for previous in state["history"].records:
            since = [] if previous.action == "replanned" else since + [previous.speedup]
        speeds = (since[1:] if len(since) > 1 else since) + [record.speedup]
        speedup = statistics.median(speeds)
        why = []
        if config.max_grad_error is not None and record.calibrated_error > config.max_grad_error:
            why.append(f"calibrated model-gradient error {record.calibrated_error:.3f} > max_grad_error "
                       f"{config.max_grad_error:g}")
        gain = None
        if payoff is not None and speedup is not None and plan.approximated:
            # Steps from what this step measured: each family's error squared times its cost (passes/payoff.py).
            steps = payoff.steps(config.backward_error_cost * record.backward_error ** 2
                                 + config.forward_error_cost * record.output_error ** 2)
            gain = speedup / steps
            if gain < config.min_gain:
                why.append(f"{speedup:.2f}x faster per step but {steps:.2f}x the steps: {gain:.2f}x < min_gain "
                           f"{config.min_gain:g}")
        if not why or not plan.approximated:
            note = "within the tolerance" + ("" if gain is None else f", predicted {gain:.2f}x sooner to a given loss")
            return dataclasses.replace(record, note=note if plan.approximated else "nothing sampled")
        if not config.check_replan:
            return dataclasses.replace(record, action="measured", note="; ".join(why) + " (check_replan=False)")
        if plan.predicted_error is None:   # only the measured policy's candidates carry the errors a re-plan needs
            return dataclasses.replace(record, action="measured",
                                       note="; ".join(why) + " (policy='flops' plans are not re-planned)")
        new = _plan_of_rank_zero(self, replan(self, plan, factors, speedup, record.step, config, "; ".join(why)))
        self._apply_plan(new)
        changed = [d for d, old in zip(new.layers, plan.layers)
                   if (d.approximate, d.mode, d.method, d.k) != (old.approximate, old.mode, old.method, old.k)]
        summary = ", ".join(f"{d.target} {'exact' if not d.approximate else f'{d.mode} {d.method} {d.keep_ratio:.2f}'}"
                            for d in changed) or "no layer changed"
        return dataclasses.replace(record, action="replanned", planned_flops=new.achieved,
                                   note="; ".join(why) + f" → {summary}")

    def _apply_plan(self, plan: Plan) -> None:
        """Give every approximated module its decision's spec (``k = n``: exact); parameters stay the same
        objects, so the optimizer's state and the state_dict keys are untouched."""
        state = self._fxapprox_state
        nodes = {n.name: n for n in self.graph.nodes}
        for decision in plan.layers:
            node = nodes.get(decision.node)
            if node is None or node.op != "call_module":
                continue
            module = self.get_submodule(node.target)
            if not isinstance(module, APPROX_MODULE_TYPES):
                continue
            spec = module.fxapprox_spec
            if decision.approximate:
                module.fxapprox_spec = SamplingSpec(method=decision.method, k=decision.k, n=decision.n,
                                                    mode=decision.mode, random_share=decision.random_share,
                                                    save_input=decision.save_input or "reference")
            else:
                module.fxapprox_spec = dataclasses.replace(spec, k=spec.n)
        state["plan"] = plan
        state["report"] = Report(plan, state["model_name"], state["report"].input_shapes, state["history"])

    # -- public surface ---------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The :class:`~fxapprox.plan.Plan` (available once planned)."""
        plan = self._fxapprox_state["plan"]
        if plan is None:
            raise PlanNotReadyError(
                "no plan yet: it is made on the first batch the module sees; run one forward pass "
                "or pass example_inputs= to fxapprox.approximate")
        return plan

    @property
    def report(self) -> Report:
        """The rewrite :class:`~fxapprox.report.Report` (available once planned)."""
        self.plan  # noqa: B018 — raises the explanatory error when not planned yet
        return self._fxapprox_state["report"]

    @property
    def saved_activation_stats(self) -> SavedActivationStats | None:
        """What the last compressing training forward kept for backward (``None`` before one ran).

        Example::

            >>> approx(x).sum().backward()
            >>> approx.saved_activation_stats.ratio     # e.g. 7.6 (times fewer bytes) at 4 bits
        """
        return self._fxapprox_state["saved_stats"]

    @property
    def history(self) -> TrainingHistory:
        """The guard's checks so far (:class:`~fxapprox.guard.TrainingHistory`; empty when ``check_every`` is
        ``None`` or nothing was trained yet).

        Example::

            >>> approx.history[-1].model_error, approx.history[-1].speedup
            >>> json.dumps(approx.history.to_dict())
        """
        return self._fxapprox_state["history"]

    @property
    def planned(self) -> bool:
        return self._fxapprox_state["plan"] is not None

    def set_approximate(self, enabled: bool) -> "ApproxGraphModule":
        """Switch approximation on (``True``) or off (``False``, exact training); returns ``self``.

        Example::

            >>> approx.set_approximate(False)   # e.g. the last epochs exact
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        self._fxapprox_state["enabled"] = enabled
        for module in self.modules():
            if isinstance(module, APPROX_MODULE_TYPES):
                module.fxapprox_enabled = enabled
        return self

    def _portable_state(self) -> dict:
        """The state without the check in flight (its hooks belong to this module's tensors)."""
        return {**self._fxapprox_state, "check": None, "in_reference": False}

    def __deepcopy__(self, memo):
        check = self._fxapprox_state.get("check")
        if check is not None:   # the check in flight holds the batch and hooks of this module's tensors
            memo[id(check)] = None
        result = super().__deepcopy__(memo)
        result._fxapprox_state = copy.deepcopy(self._portable_state(), memo)
        return result

    def __reduce__(self):
        # GraphModule pickles its generated code and re-traces it on load: that would lose this class, its
        # plan and state, the nodes' analysis meta, and the memory plan's marker nodes (outside a compressing
        # forward they do nothing, so a tracer records nothing; re-tracing them raised TraceError). The graph
        # itself pickles (its targets are importable functions, method names and submodule paths): store it.
        body = self.__dict__.copy()
        body["_fxapprox_state"] = self._portable_state()
        graph = body.pop("_graph")
        for generated in ("_code", "_lineno_map", "_prologue_start"):
            body.pop(generated, None)
        return (_rebuild_approx_graph_module, (body, _graph_records(graph), graph._codegen, type(self).__name__))


class _NodeName(str):
    """A reference to another node inside a pickled node record."""


def _graph_records(graph: torch.fx.Graph) -> list[tuple]:
    """The graph as plain records ``(op, name, target, args, kwargs, type, meta)``, node references by name
    (a ``Graph`` object refers back to its module, a cycle pickle cannot rebuild)."""
    def by_name(value):
        return torch.fx.node.map_arg(value, lambda node: _NodeName(node.name))

    return [(node.op, node.name, node.target, by_name(node.args), by_name(node.kwargs), node.type,
             _map_memory_formats(dict(node.meta), lambda f: _MemoryFormatName(str(f).rsplit(".", 1)[-1])))
            for node in graph.nodes]


class _MemoryFormatName(str):
    """A ``torch.memory_format`` by name: ShapeProp's metadata holds them and torch.save's pickle protocol (2)
    cannot pickle one."""


def _map_memory_formats(value, convert, kind=torch.memory_format):
    if isinstance(value, kind):
        return convert(value)
    if isinstance(value, dict):
        return type(value)((k, _map_memory_formats(v, convert, kind)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):   # a NamedTuple (TensorMetadata)
        return type(value)(*(_map_memory_formats(v, convert, kind) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_memory_formats(v, convert, kind) for v in value)
    return value


def _graph_from_records(records: list[tuple], codegen) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}

    def resolve(value):
        return torch.fx.node.map_aggregate(value, lambda v: nodes[v] if isinstance(v, _NodeName) else v)

    for op, name, target, args, kwargs, type_expr, meta in records:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name, type_expr=type_expr)
        node.meta = _map_memory_formats(meta, lambda name: getattr(torch, name), kind=_MemoryFormatName)
        nodes[name] = node
    graph._codegen = codegen
    return graph


def _rebuild_approx_graph_module(body: dict, records: list[tuple], codegen, class_name: str) -> "ApproxGraphModule":
    """Unpickle an :class:`ApproxGraphModule` (see ``__reduce__``): the same graph, submodules and state."""
    root = nn.Module()
    for key in ("_modules", "_parameters", "_buffers"):
        root.__dict__[key] = body[key]
    module = ApproxGraphModule(root, _graph_from_records(records, codegen), class_name=class_name)
    for key, value in body.items():
        module.__dict__[key] = value
    return module


def _plan_of_rank_zero(gm, plan: Plan) -> Plan:
    """Under DDP, rank 0's re-plan (each rank re-planned from its own timings); its choices are also recorded in
    every rank's graph meta, which the next checks' predictions read."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan
    payload = [plan.to_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    plan = Plan.from_dict(payload[0])
    nodes = {n.name: n for n in gm.graph.nodes}
    for decision in plan.layers:
        node = nodes.get(decision.node)
        if node is None or "candidates" not in fx_meta(node):
            continue
        matching = [c for c in fx_meta(node)["candidates"]
                    if (c["mode"], c["method"], c["k"]) == (decision.mode, decision.method, decision.k)]
        fx_meta(node)["chosen"] = (matching[0] if matching else fx_meta(node).get("chosen")) \
            if decision.approximate else None
    return plan


def _mean_over_ranks(values: list[float], device) -> list[float]:
    """``values`` averaged over the ranks of the default process group (unchanged when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of positional inputs, "
                    f"got {type(example_inputs).__name__}")


def approximate(model: nn.Module, budget: float | str = 0.5, *, example_inputs=None, memory_budget: float | None = None,
                method: str = "auto", config: ApproxConfig | None = None) -> ApproxGraphModule:
    """Return a copy of ``model`` whose training step spends at most ``budget`` of the exact FLOPs.

    ``budget`` is the fraction, in (0, 1], of the exact model's training-step
    FLOPs (forward + backward) the result may spend; 1.0 is exact. The measured
    policy spends less than asked where more sampling is predicted not to pay
    (it would cost more training steps than it saves time: the plan's note says
    so). ``budget="auto"``: the plan predicted to reach a given loss soonest,
    exact when none is predicted to beat exact training. With
    ``example_inputs`` the model is analysed and planned at once; otherwise on
    the first batch it sees. ``model`` is never modified; it may be an
    ``nn.Module`` or an already traced ``torch.fx.GraphModule``.

    Example::

        >>> model = torchvision.models.resnet18()
        >>> approx = fxapprox.approximate(model, budget=0.5, example_inputs=(torch.randn(8, 3, 64, 64),))
        >>> approx.report.show()
        >>> torchvision.models.resnet18().load_state_dict(approx.state_dict())
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
    inputs = None if example_inputs is None else _as_tuple(example_inputs)

    traced, counterpart = trace_both_modes(model, config.leaf_modules, strict=config.strict_trace)
    traced = follow_training_mode(traced, counterpart, training=model.training)
    model_name = type(model).__name__ if not isinstance(model, torch.fx.GraphModule) else \
        getattr(model, "_fxapprox_model_name", type(model).__name__)
    approx = ApproxGraphModule(traced, traced.graph, class_name=model_name)
    approx.meta.update(traced.meta)
    approx.training = model.training
    approx._fxapprox_setup(budget=budget, memory_budget=memory_budget, method=method, config=config,
                           model_name=model_name)
    if inputs is not None:
        approx.plan_from(*inputs)
    return approx


__all__ = ["ApproxGraphModule", "analyse", "approximate"]
