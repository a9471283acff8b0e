"""``fxapprox.bench``: exact vs approximated train steps of the user's own model, side by side.

What it measures, on the same weights and the same batch:

* **step time** — forward, loss, backward (no optimizer, so the weights never move),
  exact and approximated interleaved after warm-up, median of ``steps``;
* **saved-activation memory** — the bytes autograd keeps between forward and
  backward (distinct tensors, parameters left out): for the exact model counted by
  saved-tensor hooks (:class:`~fxapprox.count_saved_bytes`), for the approximated one
  the same way or, when ``memory_budget`` compresses activations, the compressor's own
  count of what it stored. This is the step's memory growth that approximation can
  change; weights, gradients and optimizer state are the same in both;
* **FLOPs** — planned (the plan's total for a training step) and executed
  (``torch.utils.flop_counter.FlopCounterMode`` over one approximated train step:
  the sampled ops run smaller ``mm``/``convolution`` calls, which it counts as run);
* **gradient fidelity per layer** — for every layer the plan considered that owns its
  weights, the cosine similarity and relative error ``‖g − g_exact‖ / ‖g_exact‖`` of
  its weight gradient against the exact model's. With an unbiased method one sample
  is noisy; ``fidelity_samples`` averages several backward passes' gradients first.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxapprox._validate import check_fraction, check_int
from fxapprox.api import approximate
from fxapprox.pipeline._projection import first_tensor, projection_direction, projection_loss

__all__ = ["BenchResult", "LayerFidelity", "bench"]


@dataclass(frozen=True)
class LayerFidelity:
    """How far one layer's weight gradient moved (1.0 / 0.0 when exact)."""

    name: str
    method: str            #: the plan's method, or ``"exact"`` when the layer was left exact
    keep_ratio: float
    grad_cosine: float
    grad_rel_error: float


@dataclass(frozen=True)
class BenchResult:
    """The numbers :func:`bench` measured; ``to_dict``/``to_json`` for machines, ``show`` for people."""

    exact_step_s: float
    approx_step_s: float
    speedup: float               #: exact_step_s / approx_step_s
    exact_mem_mib: float         #: saved-activation memory of an exact training forward
    approx_mem_mib: float
    memory_ratio: float          #: exact_mem_mib / approx_mem_mib (times less)
    flops_exact: int             #: FlopCounterMode over one exact train step
    flops_planned: int           #: the plan's training-step total
    flops_executed: int          #: FlopCounterMode over one approximated train step
    budget: float | str
    memory_budget: float | None
    steps: int
    layers: tuple[LayerFidelity, ...] = field(default_factory=tuple)
    #: measured relative model-gradient error: root-mean-square over the parameter-owning modules of
    #: ``‖g − g_exact‖ / ‖g_exact‖`` (the quantity the measured policy predicts)
    grad_error: float = 0.0
    #: the plan's prediction of ``grad_error`` (measured policy only)
    predicted_grad_error: float | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        return data

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def show(self, console=None) -> None:
        """Print the comparison and the per-layer fidelity as rich tables."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        summary = Table(title=f"fxapprox bench — budget {self.budget}"
                        + (f", memory_budget {self.memory_budget}" if self.memory_budget is not None else "")
                        + f", median of {self.steps} steps")
        for column in ("", "exact", "approximated", "ratio"):
            summary.add_column(column, justify="right" if column else "left")
        summary.add_row("train step", f"{self.exact_step_s * 1e3:.2f} ms", f"{self.approx_step_s * 1e3:.2f} ms",
                        f"{self.speedup:.2f}× faster")
        summary.add_row("saved-activation memory", f"{self.exact_mem_mib:.2f} MiB", f"{self.approx_mem_mib:.2f} MiB",
                        f"{self.memory_ratio:.2f}× less" if self.memory_ratio >= 1 else
                        f"{1 / self.memory_ratio:.2f}× more")
        summary.add_row("FLOPs executed", f"{self.flops_exact:,}", f"{self.flops_executed:,}",
                        f"{self.flops_executed / self.flops_exact:.3f}" if self.flops_exact else "-")
        summary.add_row("FLOPs planned", "", f"{self.flops_planned:,}", "")
        predicted = "" if self.predicted_grad_error is None else f"predicted {self.predicted_grad_error:.3f}"
        summary.add_row("model-gradient error", "0", f"{self.grad_error:.3f}", predicted)
        console.print(summary)
        layers = Table(title="weight-gradient fidelity vs exact (same weights, same batch)")
        for column in ("layer", "method", "keep", "cosine", "rel. error"):
            layers.add_column(column, justify="left" if column in ("layer", "method") else "right")
        for layer in self.layers:
            layers.add_row(layer.name, layer.method, f"{layer.keep_ratio:.3f}", f"{layer.grad_cosine:.4f}",
                           f"{layer.grad_rel_error:.4f}")
        console.print(layers)


def _random_projection_loss(model: nn.Module, inputs: tuple) -> Callable:
    """The analyses' projection loss (``fxapprox.pipeline._projection``) with its direction fixed for ``model``."""
    with torch.no_grad():
        direction = projection_direction(first_tensor(copy.deepcopy(model)(*inputs)))

    def loss(output) -> torch.Tensor:
        return projection_loss(output, direction)
    return loss


def _train_step(module: nn.Module, inputs: tuple, loss_fn: Callable) -> Callable[[], None]:
    def step() -> None:
        module.zero_grad(set_to_none=True)
        loss_fn(module(*inputs)).backward()
    return step


def _saved_mib(module: nn.Module, inputs: tuple, loss_fn: Callable, approx=None) -> float:
    from fxapprox.runtime.saved_activations import count_saved_bytes

    with count_saved_bytes(module) as counter:
        loss = loss_fn(module(*inputs))
    stats = approx.saved_activation_stats if approx is not None else None
    saved = stats.stored_bytes if stats is not None else counter.bytes
    loss.backward()
    module.zero_grad(set_to_none=True)
    return saved / 2 ** 20


def _executed_flops(step: Callable[[], None]) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def _layer_weights(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters(recurse=False) if name.startswith("weight")]


def _model_grad_error(exact: nn.Module, approx, sums: dict, samples: int) -> float:
    """Root-mean-square over parameter-owning modules of their gradients' relative error."""
    groups: dict[str, list[str]] = {}
    for name, param in exact.named_parameters():
        if param.grad is not None:
            groups.setdefault(name.rpartition(".")[0], []).append(name)
    errors = []
    exact_params = dict(exact.named_parameters())
    for names in groups.values():
        reference = torch.cat([exact_params[n].grad.detach().double().reshape(-1) for n in names])
        estimate = torch.cat([(sums[n] / samples).reshape(-1) if n in sums else torch.zeros_like(
            exact_params[n].grad, dtype=torch.float64).reshape(-1) for n in names])
        norm = reference.norm()
        if norm > 0:
            errors.append(float((estimate - reference).norm() / norm) ** 2)
    return (sum(errors) / len(errors)) ** 0.5 if errors else 0.0


def _fidelity(exact: nn.Module, approx, inputs: tuple, loss_fn: Callable,
              samples: int) -> tuple[tuple[LayerFidelity, ...], float]:
    exact_params = dict(exact.named_parameters())
    approx_modules = dict(approx.named_modules())
    _train_step(exact, inputs, loss_fn)()
    sums: dict[str, torch.Tensor] = {}
    for _ in range(samples):
        _train_step(approx, inputs, loss_fn)()
        for name, param in approx.named_parameters():
            if param.grad is not None:
                sums[name] = sums.get(name, 0) + param.grad.detach().double()
    layers = []
    for decision in approx.plan.layers:
        module = approx_modules.get(decision.target)
        weights = _layer_weights(module) if module is not None else []
        names = [f"{decision.target}.{w}" for w in weights]
        if not names or any(n not in exact_params or exact_params[n].grad is None or n not in sums for n in names):
            continue   # a functional op's weight is some other module's; measured there
        exact_grad = torch.cat([exact_params[n].grad.detach().double().reshape(-1) for n in names])
        approx_grad = torch.cat([(sums[n] / samples).reshape(-1) for n in names])
        exact_norm = exact_grad.norm()
        difference = (approx_grad - exact_grad).norm()
        denominator = exact_norm * approx_grad.norm()
        cosine = float(approx_grad @ exact_grad / denominator) if denominator > 0 else float(difference == 0)
        layers.append(LayerFidelity(
            name=decision.target, method=decision.method if decision.approximate else "exact",
            keep_ratio=decision.keep_ratio if decision.approximate else 1.0, grad_cosine=cosine,
            grad_rel_error=float(difference / exact_norm) if exact_norm > 0 else float(difference)))
    model_error = _model_grad_error(exact, approx, sums, samples)
    exact.zero_grad(set_to_none=True)
    approx.zero_grad(set_to_none=True)
    return tuple(layers), model_error


def _device_synchronizer(inputs: tuple):
    """Waits for the inputs' accelerator (CUDA, or another torch accelerator) to finish; a no-op on CPU."""
    device = inputs[0].device
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type, None)
    return (lambda: module.synchronize(device)) if hasattr(module, "synchronize") else (lambda: None)


def bench(model: nn.Module, example_inputs, *, budget: float | str = "auto", memory_budget: float | None = None,
          steps: int = 10, warmup: int = 2, method: str = "auto", config=None, loss_fn: Callable | None = None,
          fidelity_samples: int = 1, progress: bool = True) -> BenchResult:
    """Time, memory, FLOPs and per-layer gradient fidelity of ``approximate(model, ...)`` vs ``model``.

    ``model`` is not modified (both sides run on copies with the same weights).
    ``example_inputs`` is a tensor or a tuple of positional inputs; the loss is
    ``loss_fn(output)`` (default: the first output projected on a fixed random tensor).

    Example::

        >>> result = fxapprox.bench(torchvision.models.resnet18(), torch.randn(8, 3, 64, 64), budget=0.5)
        >>> result.speedup, result.memory_ratio, result.layers[0].grad_cosine
        >>> result.show()
    """
    if budget != "auto":
        check_fraction("budget", budget)
    if memory_budget is not None:
        check_fraction("memory_budget", memory_budget)
    check_int("steps", steps, minimum=1)
    check_int("warmup", warmup, minimum=0)
    check_int("fidelity_samples", fidelity_samples, minimum=1)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError("example_inputs must be a tensor or a non-empty tuple of tensors")
    loss_fn = loss_fn or _random_projection_loss(model, inputs)

    exact = copy.deepcopy(model).train()
    approx = approximate(copy.deepcopy(model).train(), budget, example_inputs=inputs,
                                  memory_budget=memory_budget, method=method, config=config)
    exact_step, approx_step = _train_step(exact, inputs, loss_fn), _train_step(approx, inputs, loss_fn)
    times: dict[str, list[float]] = {"exact": [], "approx": []}
    from rich.progress import Progress

    synchronize = _device_synchronizer(inputs)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("bench: exact vs approximated steps", total=warmup + steps)
        for repetition in range(warmup + steps):
            for name, step in (("exact", exact_step), ("approx", approx_step)):
                synchronize()   # a CUDA step returns before its kernels finish: time what ran
                start = time.perf_counter()
                step()
                synchronize()
                if repetition >= warmup:
                    times[name].append(time.perf_counter() - start)
            bar.advance(task)
    exact_s, approx_s = statistics.median(times["exact"]), statistics.median(times["approx"])
    exact_mib = _saved_mib(exact, inputs, loss_fn)
    approx_mib = _saved_mib(approx, inputs, loss_fn, approx)
    flops_exact = _executed_flops(exact_step)
    flops_executed = _executed_flops(approx_step)
    layers, grad_error = _fidelity(exact, approx, inputs, loss_fn, fidelity_samples)
    return BenchResult(
        exact_step_s=exact_s, approx_step_s=approx_s, speedup=exact_s / approx_s,
        exact_mem_mib=exact_mib, approx_mem_mib=approx_mib,
        memory_ratio=exact_mib / approx_mib if approx_mib else float("inf"),
        flops_exact=flops_exact, flops_planned=int(approx.plan.total_planned_flops), flops_executed=flops_executed,
        budget=budget, memory_budget=memory_budget, steps=steps, layers=layers, grad_error=grad_error,
        predicted_grad_error=_predicted_error(approx.plan))


def _predicted_error(plan) -> float | None:
    """The plan's predicted model-gradient error, sampled layers and compressed activations together (errors of
    different approximations add in squares, as in the policies)."""
    parts = [plan.predicted_error, plan.memory.predicted_error if plan.memory is not None else None]
    parts = [p for p in parts if p is not None]
    return math.sqrt(sum(p * p for p in parts)) if parts else None
