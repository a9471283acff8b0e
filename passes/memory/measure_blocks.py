"""Measurement — what each memory option costs in time, on the example batch: the memory policy's step-time model.

* **a checkpointed block** costs its forward once more in backward: each block (``fxapprox.passes.memory.blocks``) is
  run alone, with gradients enabled as the recomputation runs it, on the inputs it receives in the example forward;
* **a compressed copy** costs its pack (forward) and unpack (backward): timed at 8, 4 and 2 bits on a tensor the
  size of the largest value the policy may compress, with the configured kernels, per byte of the exact tensor;
* **the exact step** (forward + backward) is the unit the predictions are stated in.

Timings go through the per-machine timing cache (``fxapprox.pipeline.timing_cache``), so the same model and batch plan
the same way every run.
"""

from __future__ import annotations

import hashlib
import statistics
import time
import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.ops.quantize import quantize
from fxapprox.passes.measurement.measure_candidates import _device_of, cached_step_seconds
from fxapprox.passes.memory.blocks import Block, MemoryTimings
from fxapprox.passes.memory.measure_saved import SAVED_BITS
from fxapprox.passes.memory.rewrite_checkpoint import block_callable, checkpointed_forward
from fxapprox.passes.memory.rewrite_saved import remove_saved_markers, rewrite_saved_activations
from fxapprox.pipeline.timing_cache import TimingCache, _describe, step_key
from fxapprox.plan import MemoryPlan
from fxapprox.runtime.saved_activations import SavingOptions, compressing_saved_tensors

__all__ = ["MemoryTimings", "measure_memory_options", "measure_memory_step", "median_seconds", "pack_seconds",
           "pack_timings"]


def median_seconds(run, repeats: int) -> float:
    run()   # warm-up
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block_inputs(gm: torch.fx.GraphModule, blocks: list[Block], inputs: tuple) -> dict[str, object]:
    """The value of every node a block reads, from one forward of ``gm`` on ``inputs``."""
    wanted = {name for block in blocks for name in (*block.inputs, *block.attributes)}
    captured: dict[str, object] = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node.name in wanted:
                captured[node.name] = result
            return result

    with torch.no_grad():
        Capture(gm).run(*inputs)
    return captured


def _recompute_seconds(gm, block: Block, values: dict, repeats: int, cache: TimingCache) -> float:
    function, modules = block_callable(gm, block)
    args = [gm.get_submodule(target) for target in modules] + [values[a] for a in block.attributes]
    for name in block.inputs:
        value = values[name]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().requires_grad_(block.inputs_need_grad)
        args.append(value)
    shapes = [(target, name, tuple(p.shape), str(p.dtype)) for target in modules
              for name, p in gm.get_submodule(target).named_parameters()]
    key = "memory-block:" + hashlib.sha256(f"{function.code}\n{shapes}\n{_describe(args[len(modules):])}\n"
                                           f"{repeats}".encode()).hexdigest()
    cached = cache.get(key)
    if cached is not None:
        return cached["seconds"]
    with torch.enable_grad():
        seconds = median_seconds(lambda: function(*args), repeats)
    cache.put(key, {"seconds": seconds})
    return seconds


def pack_seconds(numel: int, dtype: torch.dtype, device, config: ApproxConfig, cache: TimingCache
                  ) -> dict[int, float]:
    key = (f"memory-pack:{numel}:{dtype}:{config.activation_group_size}:{config.activation_rounding}:"
           f"{config.activation_compile}:{config.measure_repeats}")
    cached = cache.get(key)
    if cached is not None:
        return {int(bits): seconds for bits, seconds in cached.items()}
    tensor = torch.randn(numel, dtype=dtype, device=device)
    per_byte = {}
    for bits in SAVED_BITS:
        def run(bits=bits):
            quantize(tensor, bits, group_size=config.activation_group_size, rounding=config.activation_rounding,
                     compiled=config.activation_compile).dequantize()
        per_byte[bits] = median_seconds(run, config.measure_repeats) / (numel * tensor.element_size())
    cache.put(key, {str(bits): seconds for bits, seconds in per_byte.items()})
    return per_byte


def measure_memory_options(gm: torch.fx.GraphModule, blocks: list[Block], largest: torch.fx.Node | None,
                           inputs: tuple, config: ApproxConfig) -> MemoryTimings:
    """:class:`MemoryTimings` of ``gm`` on ``inputs`` (run inside a measurement sandbox); ``largest`` is the node of
    the largest value the policy may compress (its shape and dtype time the packer)."""
    cache = TimingCache.for_config(config.timing_cache, _device_of(inputs))
    repeats = max(3, config.measure_repeats)
    step = cached_step_seconds(gm, inputs, lambda: gm.forward(*inputs), config)
    values = _block_inputs(gm, blocks, inputs) if blocks else {}
    recompute = {block.name: _recompute_seconds(gm, block, values, repeats, cache) for block in blocks}
    pack = pack_timings(largest, _device_of(inputs), config, cache)
    cache.save()
    return MemoryTimings(step, recompute, pack)


def pack_timings(largest: torch.fx.Node | None, device, config: ApproxConfig, cache: TimingCache) -> dict[int, float]:
    """Seconds per exact byte to pack and unpack a tensor the size of ``largest``'s value, at each width."""
    meta = largest.meta.get("tensor_meta") if largest is not None else None
    if meta is None or not hasattr(meta, "shape"):
        return {}
    numel = 1
    for size in meta.shape:
        numel *= int(size)
    return pack_seconds(numel, meta.dtype, device, config, cache)


def _plan_key(memory_plan: MemoryPlan) -> str:
    values = [(v.node, v.bits, v.compressed, v.recomputed_from) for v in memory_plan.values]
    blocks = [(b.name, b.recompute_bits) for b in memory_plan.checkpointed]
    return hashlib.sha256(repr((values, blocks)).encode()).hexdigest()


def measure_memory_step(gm: torch.fx.GraphModule, memory_plan: MemoryPlan, inputs: tuple, config: ApproxConfig,
                        rounds: int = 3) -> float:
    """The planned step's measured time over the exact step's: forward + backward of the projection loss with
    ``memory_plan``'s markers in ``gm`` (removed after) and its blocks checkpointed, interleaved with exact steps
    (the median of the per-round ratios, after a warm-up round). Read from the timing cache when this module,
    inputs and plan were timed on this machine before. Run inside a measurement sandbox."""
    from fxapprox.pipeline._projection import projection_loss

    cache = TimingCache.for_config(config.timing_cache, _device_of(inputs))
    key = step_key(gm, inputs) + f":memory {_plan_key(memory_plan)}:{rounds}"
    cached = cache.get(key)
    if cached is not None:
        return cached["slowdown"]
    parameters = [p for p in gm.parameters() if p.requires_grad]
    grads = [p.grad for p in parameters]
    options = SavingOptions(config.activation_group_size, config.activation_rounding, config.activation_compile)
    rewrite_saved_activations(gm, memory_plan)
    try:
        planned_forward = (checkpointed_forward(gm, memory_plan.checkpointed, options) if memory_plan.checkpointed
                           else type(gm).forward)

        def exact() -> None:
            projection_loss(gm.forward(*inputs)).backward()

        def planned() -> None:
            with compressing_saved_tensors(options, gm):
                output = planned_forward(gm, *inputs)
            # backward() rather than autograd.grad: a reentrant checkpoint refuses the latter
            projection_loss(output).backward()

        ratios = []
        for round_index in range(1 + rounds):
            seconds = []
            for step in (exact, planned):
                for parameter in parameters:
                    parameter.grad = None
                start = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - start)
            if round_index:
                ratios.append(seconds[1] / seconds[0])
    finally:
        remove_saved_markers(gm)
        for parameter, grad in zip(parameters, grads):
            parameter.grad = grad
    slowdown = statistics.median(ratios)
    cache.put(key, {"slowdown": slowdown})
    cache.save()
    return slowdown
