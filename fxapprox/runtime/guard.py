"""The guard: measured gradient error during training (``ApproxConfig(check_every=N)``).

The plan predicts each candidate's error from one batch at the initial weights, with every layer measured
alone; what training sees can differ a lot (errors compound through forward-sampled layers, the real loss's
output gradient is not the planning projection's, sensitivities grow as the model trains). So every
``check_every`` training steps, on that step's own batch, the guard compares:

* the **approximate gradients** the user's backward computes (captured by parameter hooks before they are
  accumulated into ``.grad``), against
* the **exact gradients** of the same weights on the same batch under the same output gradient: at the end of
  the user's backward, one exact forward and backward of the model on aliases of its parameters (nothing is
  written into ``.grad``, BatchNorm statistics and the RNG are restored, dropout draws the same masks:
  sampled layers draw from a forked RNG on checked steps).

It records the relative error of every parameter-owning module's gradient, the model-gradient error (their
root-mean-square: the quantity the plan predicts), the approximated layers' own errors, and the measured
speed of the approximate step against the exact one (forward + backward). :class:`CheckRecord` is one check,
:class:`TrainingHistory` all of them (``approx.history``, JSON-serialisable). What the module does with a
record (re-plan when the error passes the tolerance) is in :mod:`fxapprox.passes.guard.replan`.

Cost: one exact forward + backward every ``check_every`` steps, and one copy of the gradients on that step.
Peak memory on a checked step holds the exact pass's saved activations beside the approximate ones.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["CheckRecord", "LayerCheck", "TrainingHistory", "alignment_and_cosine", "gradient_errors", "owner_groups"]


@dataclass(frozen=True)
class LayerCheck:
    """One approximated layer at one check."""

    node: str
    target: str
    #: the plan's setting for the layer when it was checked (layers a re-plan made exact are not checked)
    method: str
    mode: str | None
    keep_ratio: float
    #: relative error of the layer's own weight gradient, measured in isolation at planning (one draw)
    planned_error: float | None
    #: relative error of the layer's own weight gradient in the whole model on this step's batch
    measured_error: float | None


@dataclass(frozen=True)
class CheckRecord:
    """What one check measured, and what the module did about it."""

    step: int
    #: measured model-gradient error: root-mean-square over parameter-owning modules of ‖g − g_exact‖ / ‖g_exact‖
    model_error: float
    #: the plan's prediction of ``model_error`` (one step: noise not averaged over steps); ``None`` when the
    #: plan was not made by the measured policy
    predicted_error: float | None
    #: the gradient error of the layers sampled in their backward (and of compressed activations): the user's
    #: gradient against the exact gradient of the same (possibly forward-sampled) forward; and its prediction
    backward_error: float
    predicted_backward_error: float
    #: ‖y − y_exact‖ / ‖y_exact‖ of the model's (first) output: what forward sampling changes; and its prediction
    output_error: float
    predicted_output_error: float
    #: the plan's effective model-gradient error (noise averaged over ``noise_horizon`` steps) with each family's
    #: predicted contributions scaled by its measured ÷ predicted ratio: what ``max_grad_error`` is compared with
    calibrated_error: float
    #: ``⟨g, g_exact⟩ / ‖g_exact‖²`` over all parameters: the share of the exact gradient's first-order loss
    #: decrease an SGD step along the approximate gradient keeps (1 when exact; below 1 when biased)
    alignment: float
    #: cosine between the approximate and the exact gradient, all parameters together
    cosine: float
    #: seconds of the exact forward + backward of this batch (the check's reference pass)
    exact_seconds: float
    #: seconds of the approximate forward + backward (the user's)
    approx_seconds: float
    layers: tuple[LayerCheck, ...] = field(default_factory=tuple)
    #: what the check decided: ``"kept"``, ``"replanned"``, or ``"measured"`` (it would have re-planned, but
    #: ``check_replan=False``)
    action: str = "kept"
    #: why (and, when re-planned, what changed)
    note: str = ""
    #: planned training FLOPs (fraction of exact) after this check's decision
    planned_flops: float = 1.0
    #: ``schedule="noise"``: the gradient noise scale's estimate ``B_noise / B`` after this check (``None``: not
    #: measured on this check)
    noise_scale: float | None = None
    #: the schedule's strength after this check (1: the plan, 0: exact)
    strength: float = 1.0
    #: a row plan's variance check (``fxapprox.runtime.row_blocks``): the ratios after it (samples kept by the
    #: blocks, tokens kept by their weight gradients), the minibatch's gradient variance and what sampling added
    #: (rows, tokens), over the sampled blocks' parameters, measured at ``checked_ratio`` / ``checked_token_ratio``
    row_ratio: float | None = None
    token_ratio: float | None = None
    sgd_variance: float | None = None
    row_variance: float | None = None
    token_variance: float | None = None
    checked_ratio: float | None = None
    checked_token_ratio: float | None = None
    #: seconds the check itself took (a variance check: its forward and its exact and sampled passes)
    check_seconds: float | None = None

    @property
    def variance_ratio(self) -> float | None:
        """A variance check's sampling variance ÷ the minibatch's (``None`` for a gradient check)."""
        if self.sgd_variance is None or not self.sgd_variance:
            return None
        return ((self.row_variance or 0.0) + (self.token_variance or 0.0)) / self.sgd_variance

    @property
    def speedup(self) -> float:
        """Measured exact / approximate forward + backward time on this step."""
        return self.exact_seconds / self.approx_seconds if self.approx_seconds > 0 else math.inf

    def to_dict(self) -> dict:
        data = asdict(self)
        data["speedup"] = self.speedup
        data["variance_ratio"] = self.variance_ratio
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "CheckRecord":
        fields = {k: v for k, v in data.items() if k not in ("speedup", "layers", "variance_ratio")}
        return cls(layers=tuple(LayerCheck(**layer) for layer in data.get("layers", ())), **fields)

    def line(self) -> str:
        """One line for the terminal (rich markup)."""
        from rich.markup import escape

        colour = {"kept": "green", "replanned": "yellow", "measured": "yellow"}.get(self.action, "white")
        if self.sgd_variance is not None:
            return (f"[bold]fxapprox variance check[/bold], step {self.step}: sampling variance "
                    f"{self.variance_ratio:.3g} × the minibatch's at rows {self.checked_ratio:.2f} / tokens "
                    f"{self.checked_token_ratio:.2f} (one draw's gradient error {self.model_error:.3f}, noise scale "
                    f"B_noise/B {self.noise_scale:.3g}); now rows {self.row_ratio:.2f}, tokens {self.token_ratio:.2f}; "
                    f"[{colour}]{self.action}[/{colour}]: {escape(self.note)}")
        return (f"[bold]fxapprox check[/bold], step {self.step}: model-gradient error {self.model_error:.3f} "
                f"(backward {self.backward_error:.3f}, predicted {self.predicted_backward_error:.3f}; output "
                f"{self.output_error:.3f}, predicted {self.predicted_output_error:.3f}); step "
                f"{self.speedup:.2f}x faster than exact; [{colour}]{self.action}[/{colour}]: {escape(self.note)}")


class TrainingHistory:
    """Every check's :class:`CheckRecord`, in order (``approx.history``).

    Example::

        >>> approx = fxapprox.approximate(model, 0.5, config=fxapprox.ApproxConfig(check_every=50))
        >>> ...  # train
        >>> [(r.step, round(r.model_error, 3)) for r in approx.history]
        >>> json.dumps(approx.history.to_dict())
    """

    def __init__(self, records=()) -> None:
        self.records: list[CheckRecord] = list(records)

    def append(self, record: CheckRecord) -> None:
        self.records.append(record)

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    @property
    def replans(self) -> int:
        return sum(r.action == "replanned" for r in self.records)

    def to_dict(self) -> dict:
        return {"records": [r.to_dict() for r in self.records]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingHistory":
        return cls(CheckRecord.from_dict(r) for r in data["records"])

    def __repr__(self) -> str:
        return f"TrainingHistory({len(self.records)} checks, {self.replans} re-plans)"


def owner_groups(names) -> dict[str, list[str]]:
    """Parameter names grouped by the module that owns them (``"blocks.0.fc1.weight"`` → ``"blocks.0.fc1"``)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.rpartition(".")[0], []).append(name)
    return groups


def _relative(estimate: list, reference: list) -> float | None:
    reference_sq = sum(float(r.double().pow(2).sum()) for r in reference)
    if reference_sq == 0.0:
        return None
    difference_sq = sum(float((e.double() - r.double()).pow(2).sum()) for e, r in zip(estimate, reference))
    return math.sqrt(difference_sq / reference_sq)


def gradient_errors(exact: dict, approx: dict, groups: dict[str, list[str]]) -> tuple[float, dict[str, float]]:
    """``(model-gradient error, {owner: relative error})`` of ``approx`` against ``exact`` gradients.

    ``exact`` / ``approx`` map parameter names to gradients (a missing or ``None`` approximate gradient counts
    as zero). Owners whose exact gradient is zero are left out. The model error is the root-mean-square of the
    owners' relative errors, the quantity the measured policy predicts.
    """
    errors: dict[str, float] = {}
    for owner, names in groups.items():
        present = [n for n in names if exact.get(n) is not None]
        if not present:
            continue
        reference = [exact[n] for n in present]
        estimate = [approx[n] if approx.get(n) is not None else torch.zeros_like(exact[n]) for n in present]
        error = _relative(estimate, reference)
        if error is not None:
            errors[owner] = error
    model = math.sqrt(sum(e * e for e in errors.values()) / len(errors)) if errors else 0.0
    return model, errors


def alignment_and_cosine(exact: dict, approx: dict) -> tuple[float, float]:
    """``(⟨g, g_exact⟩ / ‖g_exact‖², cosine(g, g_exact))`` over every parameter with an exact gradient."""
    dot = exact_sq = approx_sq = 0.0
    for name, reference in exact.items():
        if reference is None:
            continue
        reference = reference.double()
        exact_sq += float(reference.pow(2).sum())
        estimate = approx.get(name)
        if estimate is not None:
            estimate = estimate.double()
            dot += float((estimate * reference).sum())
            approx_sq += float(estimate.pow(2).sum())
    if exact_sq == 0.0:
        return 1.0, 1.0
    cosine = dot / math.sqrt(exact_sq * approx_sq) if approx_sq > 0 else 0.0
    return dot / exact_sq, cosine


def _rng_devices(tensors) -> list:
    return sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"})


class CheckStep:
    """One checked training step: wraps the user's approximate forward, and at the end of its backward runs the
    exact reference pass and hands the measured gradients to ``on_done(measurement)``.

    ``reference(args, kwargs, aliases, keep_forward)`` must run the model with its parameters replaced by
    ``aliases`` and return the output: exactly (``keep_forward=False``), or with the forward-sampled layers still
    sampled and everything else exact (``True``: with the same RNG state they keep the same pairs, so that
    pass's gradient is the exact gradient of the user's forward). ``replay``: run that second pass too. The
    measurement is a dict with the ``exact``, ``replay`` (or ``None``) and ``approx`` gradients by parameter
    name, the output's relative error and the passes' seconds.
    """

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, reference, on_done, replay: bool = False) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self.reference, self.on_done, self.replay = reference, on_done, replay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.devices = _rng_devices(tree_flatten((args, kwargs))[0])
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                         if torch.is_autocast_enabled(device)]
        self.approx_grads: dict = {}
        self.output_grads: dict = {}
        self.handles: list = []
        self.backward_start: float | None = None
        self.forward_seconds = 0.0
        self.done = False

    def _clock(self) -> float:
        """Seconds, after the queued GPU work of the batch's devices has finished (CUDA runs asynchronously)."""
        for device in self.devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    # -- the user's forward --------------------------------------------------------------------
    def run(self, call):
        from fxapprox.ops.training_context import training_context

        start = self._clock()
        with training_context(isolate_draws=True):
            output = call()
        self.forward_seconds = self._clock() - start
        leaves = tree_flatten(output)[0]
        tapped = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not tapped:
            return output
        self.first_output = (tapped[0][0], tapped[0][1].detach())
        for index, leaf in tapped:
            self.handles.append(leaf.register_hook(self._output_hook(index)))
        for name, param in self.params.items():
            self.handles.append(param.register_hook(self._param_hook(name)))
        return output

    def _output_hook(self, index: int):
        def hook(grad):
            if self.backward_start is None:
                self.backward_start = self._clock()
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.output_grads[index] = grad.detach()
        return hook

    def _param_hook(self, name: str):
        def hook(grad):
            # A copy: what is accumulated into .grad may be reduced in place (DDP) before the check reads it.
            previous = self.approx_grads.get(name)
            self.approx_grads[name] = grad.detach().clone() if previous is None else previous + grad.detach()
        return hook

    def cancel(self) -> None:
        """Remove the hooks (a forward whose backward never ran, or a finished check)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.done = True

    # -- the exact reference, at the end of the user's backward -------------------------------
    def _finish(self) -> None:
        if self.done:
            return
        approx_seconds = self.forward_seconds + self._clock() - self.backward_start
        self.cancel()
        exact, exact_seconds, output_error = self._reference_gradients(keep_forward=False)
        replay = self._reference_gradients(keep_forward=True)[0] if self.replay else None
        self.on_done({"exact": exact, "replay": replay, "approx": self.approx_grads, "exact_seconds": exact_seconds,
                      "approx_seconds": approx_seconds, "output_error": output_error})

    def _reference_gradients(self, keep_forward: bool) -> tuple[dict, float, float]:
        from fxapprox.ops.training_context import training_context

        aliases = {n: p.detach().requires_grad_(True) for n, p in self.params.items()}
        buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        start = self._clock()
        with torch.random.fork_rng(devices=self.devices), torch.enable_grad():
            torch.set_rng_state(self.cpu_rng)
            for device, state in zip(self.devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with _autocast(self.autocast), training_context(isolate_draws=True):
                output = self.reference(self.args, self.kwargs, aliases, keep_forward)
            leaves = tree_flatten(output)[0]
            index, approx_output = self.first_output
            exact_output = leaves[index].detach()
            norm = float(exact_output.double().norm())
            output_error = float((approx_output.double() - exact_output.double()).norm()) / norm if norm else 0.0
            pairs = [(leaves[i], g) for i, g in self.output_grads.items()
                     if i < len(leaves) and isinstance(leaves[i], torch.Tensor) and leaves[i].requires_grad]
            grads = torch.autograd.grad([p[0] for p in pairs], list(aliases.values()), [p[1] for p in pairs],
                                        allow_unused=True) if pairs else [None] * len(aliases)
        seconds = self._clock() - start
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                buffer.copy_(buffers[name])
        return {n: (g.detach() if g is not None else None) for n, g in zip(aliases, grads)}, seconds, output_error


@contextlib.contextmanager
def _autocast(regions):
    """Re-enter the autocast regions the user's forward ran under (the reference pass runs in backward)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in regions:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
