"""Pass 4b — measure every candidate: its errors and its speed, on the example batch.

For each layer that has candidates (see ``passes/candidates.py``):

1. **A real upstream gradient.** The model runs once exactly (training mode, in
   the analysis sandbox) with a tap after each such layer, then one backward of
   the projection loss (``fxapprox._projection``) gives every layer the gradient
   of its output and keeps a copy of its inputs.
2. **Each candidate in isolation**, like the FLOP pass: the layer's exact op and
   each candidate's approximate op (built by its op-kind handler) run forward and
   backward on copies of those inputs under that upstream gradient. For each it
   records, for what it changes — ``output`` (forward sampling), ``input_grad``
   and ``weight_grad`` — its **bias** (of the mean over the runs) and its **noise**
   (the spread of one run), both relative to the exact value's norm. Bias counts
   whole; noise averages out over the steps an optimizer's momentum spans, like
   mini-batch noise, so the effective error is
   ``sqrt(bias² + noise² / noise_horizon)``: an unbiased method with a noisy draw
   can cost less than a biased one with a smaller single-draw error (measured on
   an MLP: unbiased backward sampling at 0.5 trains within 3% of exact, top-k
   within 30%).
3. **Speed.** Unless ``min_speedup`` is ``None``, the exact op and every candidate
   are timed forward + backward, round-robin after one warm-up round, median of
   ``measure_repeats``. Layers of the same kind, shapes and settings share their
   timings (a ResNet's repeated blocks are timed once), not their errors.

Writes ``errors`` (effective), ``bias``, ``noise``, ``seconds`` and ``speedup`` into each candidate dict,
``exact_seconds`` into the node's meta, and ``norms`` (of input, output, output gradient and, for
layers with candidates, input gradient) into the meta of every parameterised node: the policy
uses them to predict how far an error travels.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxapprox._projection import projection_loss
from fxapprox.config import ApproxConfig
from fxapprox.modules import SamplingSpec
from fxapprox.op_kinds import handler_for
from fxapprox.errors import AnalysisError
from fxapprox.passes._meta import fx_meta
from fxapprox.passes.candidates import parameterised

__all__ = ["measure_candidates"]

#: methods whose runs differ only by top-k's small random share: one run measures their error
_DETERMINISTIC = ("topk",)
#: a candidate this many times below ``min_speedup`` in its first timed run is not timed again
_CLEARLY_SLOWER = 1.25


class _Tap(torch.autograd.Function):
    """Identity whose backward records the gradient flowing into a node's output (or only its norm)."""

    @staticmethod
    def forward(ctx, x, store, index, keep):
        ctx.store, ctx.index, ctx.keep = store, index, keep
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store[ctx.index] = grad.detach().clone() if ctx.keep else float(grad.detach().float().norm())
        return grad, None, None, None


def _norm(value) -> float | None:
    return float(value.detach().float().norm()) if isinstance(value, torch.Tensor) and value.numel() else None


class _UpstreamCapture(torch.fx.Interpreter):
    """Runs the graph exactly: keeps the inputs of the ``wanted`` nodes and taps their outputs; for the
    ``observed`` ones (every parameterised node) records the norms of input, output and output gradient."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set, observed: set) -> None:
        super().__init__(gm)
        self.wanted, self.observed = wanted, observed | wanted
        self.inputs: dict = {}
        self.grads: dict = {}
        self.norms: dict = {}

    def run_node(self, n):
        if n not in self.observed:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        keep = n in self.wanted
        if keep:
            self.inputs[n] = tree_map(_detached_copy, (args, kwargs))
        activation = next((a for a in args if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)),
                          None)
        result = super().run_node(n)
        leaves, spec = tree_flatten(result)
        self.norms[n] = {"input": _norm(activation), "output": _norm(leaves[0]) if leaves else None}
        store = self.grads.setdefault(n, {})
        tapped = [_Tap.apply(leaf, store, i, keep) if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf
                  for i, leaf in enumerate(leaves)]
        return tree_unflatten(tapped, spec)


def _detached_copy(value):
    if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    copy.requires_grad_(value.requires_grad and (value.is_floating_point() or value.is_complex()))
    return copy


def _call(gm: torch.fx.GraphModule, node: torch.fx.Node, args, kwargs):
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


class _Runner:
    """Runs one layer (exactly or approximately) on fresh leaves of its captured inputs."""

    def __init__(self, gm: torch.fx.GraphModule, node: torch.fx.Node, inputs, grads: dict) -> None:
        self.gm, self.node = gm, node
        self.args, self.kwargs = inputs
        handler = handler_for(fx_meta(node))
        weight_positions, weight_names = handler.gradient_operands(gm, node)
        self.weight_positions = set(weight_positions)
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        self.module_weights = [getattr(module, name) for name in weight_names] if module is not None else []
        self.grads = grads
        self.device = next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)),
                           torch.device("cpu"))

    def _leaves(self):
        inputs, weights = [], [w for w in self.module_weights if w.requires_grad]

        def leaf(value, position=None):
            if not isinstance(value, torch.Tensor):
                return value
            if isinstance(value, torch.nn.Parameter):
                fresh = value.detach().requires_grad_(value.requires_grad)
                if value.requires_grad and position in self.weight_positions:
                    weights.append(fresh)
                return fresh
            if value.requires_grad:
                fresh = value.detach().requires_grad_(True)
                inputs.append(fresh)
                return fresh
            return value
        args = tuple(leaf(a, i) for i, a in enumerate(self.args))
        kwargs = {k: leaf(v) for k, v in self.kwargs.items()}
        return args, kwargs, inputs, weights

    def run(self, fn) -> tuple[float, list, list, list]:
        """Forward + backward of ``fn``; returns (seconds, outputs, input grads, weight grads)."""
        args, kwargs, inputs, weights = self._leaves()
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        synchronize()
        start = time.perf_counter()
        leaves = tree_flatten(fn(*args, **kwargs))[0]
        outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        pairs = [(leaf, self.grads[i]) for i, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and leaf.requires_grad and i in self.grads]
        targets = inputs + weights
        grads = [None] * len(targets)
        if pairs and targets:
            grads = list(torch.autograd.grad([p[0] for p in pairs], targets, grad_outputs=[p[1] for p in pairs],
                                             allow_unused=True))
        synchronize()
        seconds = time.perf_counter() - start
        detached = [o.detach() for o in outputs]
        return seconds, detached, grads[:len(inputs)], grads[len(inputs):]


def _flat(tensors) -> list[torch.Tensor] | None:
    parts = [t.detach().reshape(-1).float() for t in tensors if t is not None]
    return parts or None


def _flat_tensor(tensors) -> torch.Tensor | None:
    parts = _flat(tensors)
    return torch.cat(parts) if parts else None


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum(torch.dot(x, y).double() for x, y in zip(a, b)))


class _ErrorAccumulator:
    """Bias and noise of each changed quantity over runs, relative to the exact one's norm.

    Over ``D`` runs with estimates ``ĝ_d`` of the exact ``g``: the noise is the sample variance
    ``Σ‖ĝ_d − ḡ‖² / (D − 1)`` and the squared bias ``‖ḡ − g‖² − noise / D`` (the mean's own noise
    removed). A deterministic method has no noise: its whole error is bias. Sums stay in fp32
    tensors (dot products accumulate in fp64): the measurement costs a few passes over each
    quantity, not a copy in double precision.
    """

    NAMES = ("output", "input_grad", "weight_grad")

    def __init__(self, exact: tuple) -> None:
        self.exact = {name: _flat(values) for name, values in zip(self.NAMES, exact)}
        self.sums: dict = {name: None for name in self.NAMES}
        self.squares = {name: 0.0 for name in self.NAMES}
        self.runs = 0

    def add(self, result: tuple) -> None:
        for name, values in zip(self.NAMES, result):
            reference, estimate = self.exact[name], _flat(values)
            if reference is None:
                continue
            if estimate is None or len(estimate) != len(reference):
                estimate = [torch.zeros_like(r) for r in reference]
            if self.sums[name] is None:
                self.sums[name] = [e.clone() for e in estimate]
            else:
                for total, part in zip(self.sums[name], estimate):
                    total.add_(part)
            self.squares[name] += _dot(estimate, estimate)
        self.runs += 1

    def errors(self, horizon: float) -> tuple[dict, dict, dict]:
        """``(effective, bias, noise)``: relative; effective² = bias² + noise² / horizon."""
        effective, bias, noise = {}, {}, {}
        for name, reference in self.exact.items():
            if reference is None or self.sums[name] is None:
                effective[name] = bias[name] = noise[name] = 0.0
                continue
            runs = self.runs
            mean = [total / runs for total in self.sums[name]]
            spread = max(self.squares[name] - runs * _dot(mean, mean), 0.0)
            variance = spread / (runs - 1) if runs > 1 else 0.0
            difference = [m - r for m, r in zip(mean, reference)]
            squared_bias = max(_dot(difference, difference) - variance / runs, 0.0)
            norm_sq = _dot(reference, reference)
            if norm_sq == 0.0:
                zero = squared_bias == 0.0 and variance == 0.0
                effective[name] = bias[name] = noise[name] = 0.0 if zero else math.inf
                continue
            bias[name] = math.sqrt(squared_bias / norm_sq)
            noise[name] = math.sqrt(variance / norm_sq)
            effective[name] = math.sqrt((squared_bias + variance / horizon) / norm_sq)
        return effective, bias, noise


def _timing_key(gm, node, args, kwargs) -> tuple:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
        return repr(value)
    module = repr(gm.get_submodule(node.target)) if node.op == "call_module" else repr(node.target)
    return (fx_meta(node).get("op_kind"), module, tuple(describe(a) for a in args),
            tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _measure_node(gm, node, inputs, grads, config: ApproxConfig, timings: dict, granularity: str) -> None:
    meta = fx_meta(node)
    handler = handler_for(meta)
    candidates = [c for c in meta["candidates"] if c["blocked"] is None]
    runner = _Runner(gm, node, inputs, grads)
    timed = config.min_speedup is not None
    key = _timing_key(gm, node, *inputs) if timed else None
    shared = timings.get(key) if timed else None
    fns = []
    for candidate in candidates:
        spec = SamplingSpec(method=candidate["method"], k=candidate["k"], n=candidate["n"], mode=candidate["mode"],
                            random_share=config.random_share if candidate["method"] == "topk" else 0.0)
        fns.append(handler.approximate_call(gm, node, spec, granularity))

    def exact_fn(*args, **kwargs):
        return _call(gm, node, args, kwargs)

    first = runner.run(exact_fn)
    meta.setdefault("norms", {})["input_grad"] = _norm(_flat_tensor(first[2]))
    accumulators = [_ErrorAccumulator(first[1:]) for _ in candidates]
    exact_times: list[float] = []
    times: list[list[float]] = [[] for _ in candidates]
    rounds = 1 + config.measure_repeats if timed and shared is None else 0
    active = set(range(len(fns)))
    for round_index in range(rounds):
        if round_index:
            exact_times.append(runner.run(exact_fn)[0])
        for index in sorted(active):
            seconds, *result = runner.run(fns[index])
            accumulators[index].add(result)
            if round_index:
                times[index].append(seconds)
        if round_index == 1:
            # A candidate clearly slower than min_speedup after the first timed round is not timed further
            # (its one timed run stands): it will not be used, and timing it again costs planning time.
            active = {i for i in active if exact_times[0] / times[i][0] >= config.min_speedup / _CLEARLY_SLOWER}
    for index, (candidate, fn) in enumerate(zip(candidates, fns)):
        draws = 1 if candidate["method"] in _DETERMINISTIC else config.error_draws
        while accumulators[index].runs < draws:
            accumulators[index].add(runner.run(fn)[1:])
        candidate["errors"], candidate["bias"], candidate["noise"] = accumulators[index].errors(
            config.noise_horizon)
    if not timed:
        meta["exact_seconds"] = None
        for candidate in candidates:
            candidate["seconds"] = candidate["speedup"] = None
        return
    if shared is None:
        exact_s = statistics.median(exact_times)
        shared = {"exact": exact_s, "candidates": {}}
        for candidate, samples in zip(candidates, times):
            shared["candidates"][_candidate_key(candidate)] = statistics.median(samples)
        timings[key] = shared
    meta["exact_seconds"] = shared["exact"]
    for candidate in candidates:
        seconds = shared["candidates"].get(_candidate_key(candidate))
        candidate["seconds"] = seconds
        candidate["speedup"] = shared["exact"] / seconds if seconds else None


def _candidate_key(candidate: dict) -> tuple:
    return (candidate["method"], candidate["mode"], candidate["k"], candidate["n"])


def measure_candidates(gm: torch.fx.GraphModule, *example_inputs, config: ApproxConfig | None = None,
                       progress: bool = False) -> torch.fx.GraphModule:
    """Measure the errors and speed of every unblocked candidate (after ``enumerate_candidates``).

    Run it inside the analysis sandbox (``fxapprox.api`` does): it runs the model in
    training mode, and BatchNorm statistics and the RNG must be restored afterwards.

    Example::

        >>> enumerate_candidates(gm, "topk", config)
        >>> measure_candidates(gm, x, config=config)
        >>> fc = gm.graph.find_nodes(op="call_module", target="fc")[0].meta["fxapprox"]
        >>> fc["candidates"][0]["errors"], fc["candidates"][0]["speedup"]
    """
    config = config or ApproxConfig()
    wanted = {n for n in gm.graph.nodes
              if any(c.get("blocked") is None for c in fx_meta(n).get("candidates", ()))}
    if not wanted:
        return gm
    torch.manual_seed(0)   # the draws, and so the plan, are the same on every run of the same model and batch
    capture = _UpstreamCapture(gm, wanted, {n for n in gm.graph.nodes if parameterised(gm, n)})
    try:
        output = capture.run(*example_inputs)
        loss = projection_loss(output)
        parameters = [p for p in gm.parameters() if p.requires_grad]
        if loss.requires_grad and parameters:
            # Gradients for the parameters, not .backward(): nothing is written into .grad. Every tap lies
            # between its layer's own weights and the loss, so each one's backward runs.
            torch.autograd.grad(loss, parameters, allow_unused=True)
    except Exception as error:
        raise AnalysisError(f"measuring candidates: the model failed on the example inputs: "
                            f"{type(error).__name__}: {error}") from error
    for node, norms in capture.norms.items():
        grads = capture.grads.get(node, {})
        grad = grads.get(0)
        fx_meta(node)["norms"] = {"input": norms["input"], "output": norms["output"],
                                  "output_grad": grad if isinstance(grad, float) or grad is None else _norm(grad)}
    granularity = config.lstm_granularity
    timings: dict = {}
    nodes = [n for n in gm.graph.nodes if n in wanted]
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("measuring candidates (error and speed)", total=len(nodes))
        for node in nodes:
            _measure_node(gm, node, capture.inputs.pop(node), capture.grads.pop(node, {}), config, timings,
                          granularity)
            bar.advance(task)
    return gm
