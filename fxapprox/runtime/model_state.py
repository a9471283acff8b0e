"""The state an approximated model carries (``approx._fxapprox_state``): what was asked, what was planned, and
what training has done since."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fxapprox.config import ApproxConfig
from fxapprox.runtime.guard import TrainingHistory

__all__ = ["ExactEval", "ModelState", "check_loaded"]


class ExactEval:
    """What evaluation runs for a model traced through torch's transformer modules
    (:mod:`fxapprox.passes.capture.torch_transformer`): the model traced with those modules whole, so that they
    run torch's own forward (its inference fast path and nested tensors included) on the approximated model's
    parameters and buffers.

    The model's own call stays the entry (its hooks — FSDP2's unsharding among them — run): inside
    :meth:`calling`, :meth:`dispatching_forward` runs this graph instead of the training graph. The two graphs
    share their tensors; before each call the ones the approximated model holds now (an optimizer steps them in
    place, but ``load_state_dict(assign=True)``, ``to_empty`` or FSDP2 replace them) are put where the evaluation
    graph's modules read them."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        self.module = module
        self.active = False
        by_prefix: dict[str, list] = {}
        for name, _ in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            prefix, _, leaf = name.rpartition(".")
            by_prefix.setdefault(prefix, []).append(leaf)
        #: (path, this graph's module there, the tensor names it holds): resolved once, the owner's side per call
        self._holders = [(tuple(prefix.split(".")) if prefix else (), module.get_submodule(prefix), leaves)
                         for prefix, leaves in by_prefix.items()]

    @contextlib.contextmanager
    def calling(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def __call__(self, owner: torch.nn.Module, args: tuple, kwargs: dict):
        self._share(owner)
        if self.module.training != owner.training:
            self.module.train(owner.training)
        return self.module(*args, **kwargs)

    @staticmethod
    def dispatching_forward(forward):
        """``forward`` (a ``GraphModule``'s generated code) running the owner's :class:`ExactEval` instead while it is
        :meth:`calling` (the plain ``forward`` for a model without one)."""
        @functools.wraps(forward)
        def dispatching(self, *args, **kwargs):
            exact = self._fxapprox_state.exact_eval
            if exact is not None and exact.active:
                return exact(self, args, kwargs)
            return forward(self, *args, **kwargs)
        return dispatching

    def _share(self, owner: torch.nn.Module) -> None:
        for path, mine, leaves in self._holders:
            theirs = owner   # by path, each call: the rewrite swaps modules, FSDP2 swaps tensors
            for part in path:
                theirs = theirs._modules[part]
            for name in leaves:
                registry = mine._parameters if name in mine._parameters else mine._buffers
                current = theirs._parameters.get(name, theirs._buffers.get(name))
                if registry[name] is not current:
                    registry[name] = current


@dataclass
class ModelState:
    """One approximated model's state. Mutable: planning, training steps and re-plans update it in place."""

    # -- what was asked (``fxapprox.approximate``'s arguments) --------------------------------------------------
    budget: float | str
    memory_budget: float | None
    method: str
    config: ApproxConfig
    model_name: str
    # -- what was planned ---------------------------------------------------------------------------------------
    #: the current plan and its report (``None`` until the first batch or ``example_inputs``)
    plan: Any = None          # fxapprox.plan.Plan
    report: Any = None        # fxapprox.report.Report
    #: the config the memory plan was made with (``activation_recompute="auto"`` decided)
    memory_config: ApproxConfig | None = None
    #: the compressed-saving options of the memory plan, ``None`` without one
    saving: Any = None        # fxapprox.runtime.saved_activations.SavingOptions
    #: region-captured models (``fxapprox.pipeline.eager``): the root region and the stitched planning graph
    root: dict | None = None
    planning: Any = None      # torch.fx.GraphModule
    #: submodules torch.fx could not trace (``UntracedModule.to_dict``), captured region by region with the root
    untraced: tuple = ()
    # -- what training has done --------------------------------------------------------------------------------
    #: ``set_approximate``: sampled ops on (``True``) or the exact model
    enabled: bool = True
    training_steps: int = 0
    history: TrainingHistory = field(default_factory=TrainingHistory)
    #: the last training step's saved-activation statistics (compressed saving only)
    saved_stats: Any = None   # fxapprox.runtime.saved_activations.SavedActivationStats
    #: the guard's check in flight (holds a batch and hooks on this module's tensors), or ``None``
    check: Any = None
    #: ``True`` while the exact reference runs inside a check
    in_reference: bool = False
    #: memory re-plans so far (``replan_memory``)
    replans: int = 0
    warned_compile: bool = False
    #: the schedule's strength in force (``fxapprox.schedule``: 1 the plan, 0 exact)
    strength: float = 1.0
    #: the training FLOPs the steps so far executed, in exact steps (÷ ``training_steps``: ``executed_flops``)
    executed_flops_sum: float = 0.0
    #: ``schedule="noise"``: the gradient noise scale's estimate and the last check's exact gradients
    noise: Any = None         # fxapprox.schedule.NoiseScale
    noise_pending: Any = None  # (step, {name: exact gradient})
    #: the checkpointed training forward and the graph code it was built from (``ApproxRuntime``), rebuilt on demand
    checkpointed: Any = None
    #: the compiled-saving widths and unmarked training forward (``torch.compile``), and what they were built from
    compiled_saving: Any = None
    #: a row plan's sampler (``fxapprox.ops.rows.RowSampler``, shared with its blocks), the traced model's row-sampled
    #: training forward and what it was built from, and whether the planned step's timing switched sampling off
    row_sampler: Any = None
    row_forward: Any = None
    rows_off: bool = False
    #: a model traced through torch's transformer modules: what evaluation runs (:class:`ExactEval`), else ``None``
    exact_eval: ExactEval | None = None

    def portable(self) -> "ModelState":
        """A copy without the check in flight (its hooks belong to this module's tensors) and without the noise
        schedule's held gradients (the next pair of checks starts afresh), for copies and pickles."""
        if self.exact_eval is not None:
            self.exact_eval.active = False
        return dataclasses.replace(self, check=None, in_reference=False, noise_pending=None, checkpointed=None,
                                   compiled_saving=None, row_forward=None, rows_off=False)


def check_loaded(body: dict) -> None:
    """Refuse, saying what to do, a model pickled by an fxapprox from before ``ModelState`` and the typed node
    records (its state a dict, its analysis one ``node.meta["fxapprox"]`` dict): its planning state cannot be
    read back, its weights can."""
    if isinstance(body.get("_fxapprox_state"), dict):
        raise ValueError("this approximated model was saved by an earlier fxapprox whose planning state this "
                         "version cannot read; load its state_dict() into the original model and call "
                         "fxapprox.approximate again")
