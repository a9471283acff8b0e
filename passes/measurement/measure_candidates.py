"""Pass 4b — measure every candidate: its errors and its speed, on the example batch.

For each layer that has candidates (see ``passes/measurement/candidates.py``):

1. **A real upstream gradient.** The model runs once exactly (training mode, in
   the analysis sandbox) with a tap after each such layer, then one backward of
   the projection loss (``fxapprox.pipeline._projection``) gives every layer the gradient
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

Writes each layer's candidates again with their ``errors`` (effective), ``bias``, ``noise``, ``seconds`` and
``speedup``, and the exact op's ``exact_seconds`` (its :class:`~fxapprox.pipeline.records.LayerCandidates`), and the
norms (of input, output, output gradient and, for layers with candidates, input gradient) of every
parameterised node (its :class:`~fxapprox.pipeline.records.ActivationNorms`): the policy
uses them to predict how far an error travels. With timing on, the exact model's whole forward + backward
is timed too (``gm.meta[EXACT_STEP_KEY]``): the step the layers' time savings are a part of.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
import zlib

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from fxapprox.config import ApproxConfig
from fxapprox.errors import AnalysisError
from fxapprox.op_kinds.registry import handler_for
from fxapprox.ops.lstm import LSTMBackward
from fxapprox.passes.measurement._upstream import ErrorAccumulator, call_node, capture_upstream, total_norm
from fxapprox.passes.measurement.candidates import parameterised
from fxapprox.pipeline.records import CANDIDATES_KEY, Candidate, candidates_of, kind_of, write_norms
from fxapprox.pipeline.timing_cache import TimingCache, step_key
from fxapprox.runtime.modules import SamplingSpec

__all__ = ["EXACT_STEP_KEY", "cached_step_seconds", "measure_candidates", "planned_step_speedup", "time_exact_step",
           "time_step"]

#: methods whose runs differ only by top-k's small random share: one run measures their error
_DETERMINISTIC = ("topk",)
#: a candidate this many times below ``min_speedup`` in its first timed run is not timed again
_CLEARLY_SLOWER = 1.25


class _Runner:
    """Runs one layer (exactly or approximately) on fresh leaves of its captured inputs."""

    def __init__(self, gm: torch.fx.GraphModule, node: torch.fx.Node, inputs, grads: dict) -> None:
        self.gm, self.node = gm, node
        self.args, self.kwargs = inputs
        handler = handler_for(node)
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


def _timing_key(gm, node, args, kwargs) -> tuple:
    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
        return repr(value)
    module = repr(gm.get_submodule(node.target)) if node.op == "call_module" else repr(node.target)
    return (kind_of(node).op_kind, module, tuple(describe(a) for a in args),
            tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _measure_node(gm, node, inputs, grads, config: ApproxConfig, timings: dict, lstm: LSTMBackward,
                  cache: TimingCache) -> None:
    layer = candidates_of(node)
    handler = handler_for(node)
    candidates = [c for c in layer.candidates if c.blocked is None]
    runner = _Runner(gm, node, inputs, grads)
    timed = config.min_speedup is not None
    key = _timing_key(gm, node, *inputs) if timed else None
    cache_key = None
    if timed:
        described = repr((key, sorted(_candidate_key(c) for c in candidates), config.measure_repeats))
        cache_key = "layer:" + hashlib.sha256(described.encode()).hexdigest()
    shared = (timings.get(key) or cache.get(cache_key)) if timed else None
    fns = []
    for candidate in candidates:
        spec = SamplingSpec(method=candidate.method, k=candidate.k, n=candidate.n, mode=candidate.mode,
                            random_share=config.random_share if candidate.method == "topk" else 0.0)
        fns.append(handler.approximate_call(gm, node, spec, lstm))

    def exact_fn(*args, **kwargs):
        return call_node(gm, node, args, kwargs)

    first = runner.run(exact_fn)
    write_norms(node, input_grad=total_norm(first[2]))
    accumulators = [ErrorAccumulator(first[1:]) for _ in candidates]
    draws = [1 if c.method in _DETERMINISTIC else config.error_draws for c in candidates]
    runs = [0] * len(candidates)

    def run_candidate(index: int) -> float:
        # Each run of a candidate draws from its own seed, and only the first ``draws`` runs measure its error: the
        # errors are the same whether its timing runs happen (a cold timing cache) or not (a warm one).
        torch.manual_seed(zlib.crc32(f"{node.name}/{index}/{runs[index]}".encode()))
        seconds, *result = runner.run(fns[index])
        if runs[index] < draws[index]:
            accumulators[index].add(result)
        runs[index] += 1
        return seconds
    exact_times: list[float] = []
    times: list[list[float]] = [[] for _ in candidates]
    rounds = 1 + config.measure_repeats if timed and shared is None else 0
    active = set(range(len(fns)))
    for round_index in range(rounds):
        if round_index:
            exact_times.append(runner.run(exact_fn)[0])
        for index in sorted(active):
            seconds = run_candidate(index)
            if round_index:
                times[index].append(seconds)
        if round_index == 1:
            # A candidate clearly slower than min_speedup after the first timed round is not timed further
            # (its one timed run stands): it is used only where a budget needs its FLOPs, and timing it again
            # costs planning time.
            active = {i for i in active if exact_times[0] / times[i][0] >= config.min_speedup / _CLEARLY_SLOWER}
    measured: dict[int, Candidate] = {}
    for index, candidate in enumerate(candidates):
        while runs[index] < draws[index]:
            run_candidate(index)
        errors, bias, noise = accumulators[index].errors(config.noise_horizon)
        measured[index] = dataclasses.replace(candidate, errors=errors, bias=bias, noise=noise)
    exact_seconds = None
    if timed:
        if shared is None:
            exact_s = statistics.median(exact_times)
            shared = {"exact": exact_s, "candidates": {}}
            for candidate, samples in zip(candidates, times):
                shared["candidates"][_candidate_key(candidate)] = statistics.median(samples)
            cache.put(cache_key, shared)
        timings[key] = shared
        exact_seconds = shared["exact"]
        for index, candidate in measured.items():
            seconds = shared["candidates"].get(_candidate_key(candidate))
            measured[index] = dataclasses.replace(candidate, seconds=seconds,
                                                  speedup=shared["exact"] / seconds if seconds else None)
    else:
        measured = {i: dataclasses.replace(c, seconds=None, speedup=None) for i, c in measured.items()}
    unblocked = iter(measured[i] for i in range(len(candidates)))
    node.meta[CANDIDATES_KEY] = dataclasses.replace(
        layer, exact_seconds=exact_seconds,
        candidates=tuple(next(unblocked) if c.blocked is None else c for c in layer.candidates))


#: where the exact training step's measured seconds go (``gm.meta``): the policy's whole-step speed model
EXACT_STEP_KEY = "fxapprox_exact_step_seconds"


def time_step(module: torch.nn.Module, forward, repeats: int, inputs=(), warmup: bool = True) -> float:
    """Median seconds of ``forward()`` and the backward of its projection loss to ``module``'s trainable parameters
    and to the tensors among ``inputs`` that require a gradient (the layers' timed candidates compute their input
    gradients too), after one warm-up run (``warmup=False``: one timed run, no warm-up)."""
    from fxapprox.pipeline._projection import projection_loss

    parameters = [p for p in module.parameters() if p.requires_grad]
    parameters += [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    synchronize = torch.cuda.synchronize if any(p.is_cuda for p in parameters) else (lambda: None)
    times = []
    for run in range(1 + repeats if warmup else max(1, repeats)):
        synchronize()
        start = time.perf_counter()
        loss = projection_loss(forward())
        if loss.requires_grad and parameters:
            torch.autograd.grad(loss, parameters, allow_unused=True)
        synchronize()
        if run or not warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def cached_step_seconds(module: torch.nn.Module, inputs, forward, config: ApproxConfig) -> float:
    """:func:`time_step` of ``forward``, read from the timing cache when this module and these inputs were timed on
    this machine before (``fxapprox.pipeline.timing_cache``)."""
    cache = TimingCache.for_config(config.timing_cache, _device_of(inputs))
    key = step_key(module, inputs) + f":{config.measure_repeats}"
    cached = cache.get(key)
    if cached is not None:
        return cached["seconds"]
    seconds = time_step(module, forward, config.measure_repeats, inputs)
    cache.put(key, {"seconds": seconds})
    cache.save()
    return seconds


def planned_step_speedup(module: torch.nn.Module, inputs, forward, set_sampling, fingerprint: str,
                         config: ApproxConfig, rounds: int = 4) -> float:
    """The planned step's measured speed-up: exact ÷ sampled forward + backward of the projection loss on the
    example inputs, in interleaved rounds (the median of the per-round ratios; the machine drifts between runs, far
    less within a round), after a warm-up round. ``set_sampling(bool)`` switches the rewritten model's sampled ops
    on and off. Read from the timing cache when this module, inputs and plan (``fingerprint``) were timed on this
    machine before. It is what the plan predicts for a training step: the layers' isolated timings add up to it only
    roughly (a layer's saving inside the step differs from its saving alone)."""
    cache = TimingCache.for_config(config.timing_cache, _device_of(inputs))
    key = step_key(module, inputs) + f":plan {fingerprint}:{rounds}"
    cached = cache.get(key)
    if cached is not None:
        return cached["speedup"]
    ratios = []
    try:
        for round_index in range(1 + rounds):
            seconds = {}
            for sampling in (False, True):
                set_sampling(sampling)
                seconds[sampling] = time_step(module, forward, 0, inputs, warmup=False)
            if round_index:
                ratios.append(seconds[False] / seconds[True])
    finally:
        set_sampling(True)
    speedup = statistics.median(ratios)
    cache.put(key, {"speedup": speedup})
    cache.save()
    return speedup


def time_exact_step(gm: torch.fx.GraphModule, example_inputs: tuple, config: ApproxConfig) -> float:
    """Median seconds of the exact model's forward + backward (the projection loss) on the example inputs, after
    one warm-up run: the whole step the layers' measured savings are a part of."""
    # not gm(): an ApproxGraphModule plans on call
    return cached_step_seconds(gm, example_inputs, lambda: gm.forward(*example_inputs), config)


def _device_of(inputs) -> torch.device:
    return next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _candidate_key(candidate: Candidate) -> str:
    return f"{candidate.method} {candidate.mode} {candidate.k}/{candidate.n}"


def measure_candidates(gm: torch.fx.GraphModule, *example_inputs, config: ApproxConfig | None = None,
                       progress: bool = False) -> torch.fx.GraphModule:
    """Measure the errors and speed of every unblocked candidate (after ``enumerate_candidates``).

    Run it inside the analysis sandbox (``fxapprox.api`` does): it runs the model in
    training mode, and BatchNorm statistics and the RNG must be restored afterwards.

    Example::

        >>> enumerate_candidates(gm, "topk", config)
        >>> measure_candidates(gm, x, config=config)
        >>> fc = candidates_of(gm.graph.find_nodes(op="call_module", target="fc")[0])
        >>> fc.candidates[0].errors, fc.candidates[0].speedup
    """
    config = config or ApproxConfig()
    wanted = {n for n in gm.graph.nodes
              if candidates_of(n) is not None and any(c.blocked is None for c in candidates_of(n).candidates)}
    if not wanted:
        return gm
    torch.manual_seed(0)   # the draws, and so the plan, are the same on every run of the same model and batch
    try:
        capture = capture_upstream(gm, wanted, {n for n in gm.graph.nodes if parameterised(gm, n)}, example_inputs)
    except Exception as error:
        raise AnalysisError(f"measuring candidates: the model failed on the example inputs: "
                            f"{type(error).__name__}: {error}") from error
    lstm = LSTMBackward(config.lstm_granularity, config.lstm_block_steps)
    timings: dict = {}
    cache = TimingCache.for_config(config.timing_cache, _device_of(example_inputs))
    if config.min_speedup is not None:
        gm.meta[EXACT_STEP_KEY] = time_exact_step(gm, example_inputs, config)
    nodes = [n for n in gm.graph.nodes if n in wanted]
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("measuring candidates (error and speed)", total=len(nodes))
        for node in nodes:
            _measure_node(gm, node, capture.inputs.pop(node), capture.grads.pop(node, {}), config, timings,
                          lstm, cache)
            bar.advance(task)
    cache.save()
    return gm
