"""``fxapprox.approximate``: trace → analyse → rank → plan → rewrite → report.

Each stage is a pass in ``fxapprox.passes``; this module only strings them
together and wraps the result in :class:`ApproxGraphModule`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import torch
import torch.fx
from torch import nn

from fxapprox._validate import check_choice, check_fraction
from fxapprox.config import ApproxConfig
from fxapprox.errors import PlanNotReadyError
from fxapprox.modules import APPROX_MODULE_TYPES
from fxapprox.ops.attention import as_in_compressed_training
from fxapprox.ops.sampling import METHODS
from fxapprox.passes.attention_recompute import recompute_attention
from fxapprox.passes.budget_policy import plan_budget
from fxapprox.passes.candidates import enumerate_candidates
from fxapprox.passes.channels import annotate_channels
from fxapprox.passes.compact_pooling import compact_max_pools
from fxapprox.passes.flops import count_flops
from fxapprox.passes.input_saving import plan_input_saving
from fxapprox.passes.measure_candidates import measure_candidates
from fxapprox.passes.measure_saved import measure_saved_values
from fxapprox.passes.memory_policy import memory_candidates, plan_memory, resolve_recompute
from fxapprox.passes.rank import rank_layers
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
                                "enabled": True, "saving": None, "saved_stats": None}

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
        if config.policy == "measured" and state["budget"] < 1.0:
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
        state["report"] = Report(plan, state["model_name"], _shapes(inputs))
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
        state["report"] = Report(plan, state["model_name"], _shapes(inputs))
        state["replans"] = state.get("replans", 0) + 1
        return plan

    def __call__(self, *args, **kwargs):
        state = self._fxapprox_state
        if state["plan"] is None:
            self.plan_from(*args, **kwargs)
        if state["saving"] is None or not (state["enabled"] and self.training and torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)
        if torch.compiler.is_compiling():
            warnings.warn("fxapprox: with a memory plan (memory_budget) the training forward runs eagerly under "
                          "torch.compile (compressed activation saving is not compiled); the sampled ops of a "
                          "compute-only plan compile", RuntimeWarning, stacklevel=2)
        return self._compressing_call(*args, **kwargs)

    @torch._dynamo.disable
    def _compressing_call(self, *args, **kwargs):
        # Eager under torch.compile (a graph break here): the pack hooks key saved tensors by storage and the
        # markers tag graph values as they are made, neither of which survives inductor's rewriting of the
        # forward and of what it saves.
        state = self._fxapprox_state
        every = state["config"].activation_replan_every
        state["training_steps"] = state.get("training_steps", 0) + 1
        if every and state["training_steps"] % every == 0 and state["memory_budget"] is not None:
            self.replan_memory(*args, **kwargs)
        with compressing_saved_tensors(state["saving"], self) as compressor:
            output = super().__call__(*args, **kwargs)
        state["saved_stats"] = compressor.stats()
        return output

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

    def __deepcopy__(self, memo):
        result = super().__deepcopy__(memo)
        result._fxapprox_state = copy.deepcopy(self._fxapprox_state, memo)
        return result

    def __reduce__(self):
        # GraphModule pickles its generated code and re-traces it on load: that would lose this class, its
        # plan and state, the nodes' analysis meta, and the memory plan's marker nodes (outside a compressing
        # forward they do nothing, so a tracer records nothing; re-tracing them raised TraceError). The graph
        # itself pickles (its targets are importable functions, method names and submodule paths): store it.
        body = self.__dict__.copy()
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


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of positional inputs, "
                    f"got {type(example_inputs).__name__}")


def approximate(model: nn.Module, budget: float = 0.5, *, example_inputs=None, memory_budget: float | None = None,
                method: str = "auto", config: ApproxConfig | None = None) -> ApproxGraphModule:
    """Return a copy of ``model`` whose training step spends at most ``budget`` of the exact FLOPs.

    ``budget`` is the fraction, in (0, 1], of the exact model's training-step
    FLOPs (forward + backward) the result may spend; 1.0 is exact. With
    ``example_inputs`` the model is analysed and planned at once; otherwise on
    the first batch it sees. ``model`` is never modified; it may be an
    ``nn.Module`` or an already traced ``torch.fx.GraphModule``.

    Example::

        >>> model = torchvision.models.resnet18()
        >>> approx = fxapprox.approximate(model, budget=0.5, example_inputs=(torch.randn(8, 3, 64, 64),))
        >>> approx.report.show()
        >>> torchvision.models.resnet18().load_state_dict(approx.state_dict())
    """
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
