"""Configuration: small frozen dataclasses, validated on construction.

The common case needs no config at all (``approximate(model, budget=0.5)``);
:class:`ApproxConfig` is for finer control, :class:`~fxapprox.pipeline.overrides.LayerOverride` (its ``overrides``) pins
the decision for layers matched by name, regular expression or module type.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from torch import nn

from fxapprox.config.validation import validate
from fxapprox.ops.lstm import DEFAULT_BLOCK_STEPS
from fxapprox.pipeline.overrides import LayerOverride
from fxapprox.runtime.modules import MODES

#: the candidates ``method="auto"`` measures, per mode (see docs/planning.md)
#: forward sampling keeps the papers' top-k (unbiased forward sampling compounds its noise through the layers
#: above); the backward modes use WTA-CRS: on the char transformer top-k's bias cost 14–25% validation loss where
#: WTA-CRS cost 3–12% at the same ratios (BENCHMARKS.md, planner calibration)
AUTO_METHODS = {"forward": ("topk",), "backward": ("wta_crs",), "weight_grad": ("wta_crs",)}


@dataclass(frozen=True, kw_only=True)
class ApproxConfig:
    """Finer control over tracing, the compute plan, its pay-off and guard, saved activations and LSTM layers.

    Every field is a keyword argument. They come in seven sections, in this order in the code, in this list and
    in docs/configuration.md.

    Tracing:

    - ``leaf_modules``: module qualified names or types the tracer keeps opaque
      (recurrent modules are always leaves).
    - ``strict_trace``: ``False`` (default): where the model's own code, or a
      submodule holding approximable layers, does not trace, the model is captured
      region by region (``Plan.regions``, docs/hugging_face.md) and its layers are in
      the plan; a submodule without such layers that does not trace is kept whole
      and exact; the plan and report say which and why (``Plan.untraced``);
      ``True``: raise :class:`fxapprox.TraceError` instead.
    - ``progress``: show a progress bar while the analysis passes run.

    The compute plan:

    - ``policy``: how the budget is spent. ``"measured"`` (default): every
      candidate (method × mode × keep-ratio on ``keep_ratios``) of every layer is
      run on the example batch in isolation; its errors (output, input gradient,
      weight gradient, against the exact ones under a real upstream gradient) and
      its speed against the exact op are measured, and the plan meets the budget
      with the least predicted model-gradient error, never beyond
      ``max_grad_error``. ``"flops"``: the FLOP-ranked walk at one common
      keep-ratio (``keep_ratio``, lowered to ``min_keep_ratio``). ``"uniform"``:
      the papers' recipe, every eligible layer at ``keep_ratio`` (combine with
      ``min_channels`` for "layers with ≥ N channels at ratio r"); see
      :meth:`paper_recipe`.
    - ``overrides``: :class:`LayerOverride` rules; the first matching rule wins.
    - ``keep_ratios``: the keep-ratio grid the measured policy tries.
    - ``max_grad_error``: the measured policy's tolerance: the predicted relative
      error of the model's gradient (the root-mean-square over its parameterised
      layers of each one's relative gradient error). A numeric budget is spent
      within it where the candidates allow, and past it where the budget needs more
      (the plan then warns); ``budget="auto"`` never goes past it. ``None``: no limit.
    - ``min_speedup``: a candidate should run at least this much faster than the
      exact op (fwd + bwd, median of ``measure_repeats`` timed runs, paired). A numeric
      budget takes slower candidates only where the faster ones cannot meet it (the
      plan warns); ``budget="auto"`` never does. ``None`` skips timing (plans then
      depend on FLOPs and errors only, and are identical on every machine — e.g. for
      tests or several ranks planning apart).
    - ``timing_cache``: keep measured timings in a per-machine cache file and reuse
      them, so the same model, batch and seed plan the same way on every run instead
      of following timing noise (as inductor caches its autotuning). ``True``
      (default): ``$FXAPPROX_CACHE_DIR`` or ``~/.cache/fxapprox``; a path: that
      directory; ``False``: time afresh on every plan.
    - ``measure_repeats``: timed runs per candidate and per exact op.
    - ``error_draws``: draws over which an unbiased method's bias and noise are
      measured (its expected error, not one sample's).
    - ``noise_horizon``: steps over which a candidate's noise averages out (like
      mini-batch noise): its effective error is ``sqrt(bias² + noise² / noise_horizon)``;
      ``1`` treats noise like bias. The default 30 was fitted to training runs (an
      unbiased estimator with a noisy draw costs far less than a biased one).
    - ``keep_ratio``: the keep-ratio the ``"flops"`` policy prefers (it approximates
      layers in rank order at this ratio until the budget is met) and the ratio of
      ``"uniform"``.
    - ``min_keep_ratio``: the ``"flops"`` policy's floor; if the budget needs less,
      the policy stops at the floor and the report says what was achieved.
    - ``min_channels``: layers reducing over fewer channels/features stay exact
      (the 3-channel stem, tiny heads).
    - ``min_k``: a layer whose kept-pair count would fall below this stays exact.
    - ``mode``: restrict every layer to one sampling mode: ``"forward"`` (forward,
      input- and weight-gradient GEMMs all shrink), ``"backward"`` (forward exact,
      both backward GEMMs sampled) or ``"weight_grad"`` (only the weight-gradient
      GEMM sampled, over batch rows / tokens). ``None`` (default): the measured
      policy chooses per layer; the other policies use ``"forward"``.
    - ``random_share``: share of top-k's kept pairs drawn at random instead, so no
      column starves (never picked, never updated); 0 gives pure top-k.

    Row sampling (``docs/row_sampling.md``):

    - ``row_sampling``: let the plan sample the rows of the backward: in each block that treats its samples
      independently (a transformer layer), the backward keeps a share of the batch's samples, chosen by their
      gradient norms and rescaled (unbiased), and runs on them only; the forward stays exact. A numeric budget is
      spent this way where the blocks reach it; ``budget="auto"`` holds the sampling variance at ``variance_tau``
      × the minibatch's. ``False``: the other families only.
    - ``variance_tau``: ``budget="auto"``'s bound on each part of the sampling variance (rows; tokens of the weight
      gradients), as a share of the minibatch's own gradient variance over the sampled blocks' parameters (VCAS's
      0.025).
    - ``row_check_every``: every this many training steps, measure the minibatch's gradient variance and the
      sampling's on that step's batch, with its loss (``approx.history``); under ``budget="auto"`` the ratios
      follow. The first training step is always checked: it calibrates the ratios (``"auto"`` trains it exactly).
      ``None``: that check only.
    - ``token_ratios``: the shares of a kept sample's tokens the linear layers' weight gradients may keep
      (leverage-score sampling, unbiased); a numeric budget takes the one of least measured variance, ``"auto"``
      goes no lower than the smallest.
    - ``max_forward_kl``: a numeric budget keeps the forward exact (rows) where sampling the forward would move the
      model's predictions on the example batch by more than this (``KL(exact ‖ sampled)``, nats per output row,
      every linear layer's forward top-k at the budget's keep-ratio): a trained model's (fine-tuning) moves by ~1,
      one at its initial weights by ~0.01. Below it, the forward may be sampled and the other families spend the
      budget. ``None``: rows wherever the blocks reach the budget.

    Pay-off and the guard (``docs/loss_per_second.md``):

    - ``min_gain``: ``budget="auto"``'s threshold: the plan must be predicted to reach a
      given loss at least this much sooner than exact training (predicted step speed-up
      ÷ predicted steps); it stops sampling where the predicted gain peaks and keeps the
      model exact when the peak is below this. A numeric budget is spent regardless, and
      its report says what ``"auto"`` would do. ``None``: no advice (and no ``"auto"``).
    - ``backward_error_cost`` / ``forward_error_cost``: predicted extra steps per squared
      error of each family — one step's gradient error for layers sampled in their
      backward (and compressed activations), the model output's relative error for
      layers sampled in their forward (``fxapprox.passes.policy.payoff``), for a step of a run that
      samples every step (``schedule="constant"``). Fitted on the end-of-schedule protocol
      (``benchmarks/time_to_quality.py``: the budget spent on one family every step, final
      loss against exact schedules of several lengths).
    - ``backward_tail_factor`` / ``forward_tail_factor``: the share of each family's extra
      steps still owed at the end of a schedule whose last steps train exactly (``"mixed"``,
      ``"anneal"``): a forward-sampled run is largely recovered by its exact tail, a
      backward-sampled one much less. Fitted on the same protocol (``"mixed"`` runs of one
      family); ``ApproxConfig.error_costs`` gives the costs the planner uses.
    - ``check_every``: every this many training steps, measure the approximate gradient
      against an exact backward on the same batch (``approx.history``) and re-plan:
      under ``budget="auto"`` when the error passes ``max_grad_error`` or the plan stops
      paying, under a numeric budget only when it passes ``divergence_error``. An exact
      plan is never checked. ``None``: no guard.
    - ``plan_check``: before training, run the measured policy's plan on the example batch against
      exact training (forward and backward, as the guard does) and, where a family of
      approximation shows more error than predicted, make the plan again with its candidates'
      errors scaled by the measured factor (``passes/guard/check_plan.py``; a stack of backward-sampled
      layers compounds its noise far past the layers' isolated errors).
    - ``divergence_error``: the calibrated model-gradient error past which the guard
      re-plans a numeric budget (the approximate gradient is then farther from the exact
      one than the exact one is from zero); the re-plan moves the plan no further from
      the budget than this needs, and the check records how far.
    - ``check_replan``: act on a check (``False``: measure and record only).
    - ``check_verbose``: print one line per check.

    The schedule over training (``fxapprox.schedule``, docs/loss_per_second.md):

    - ``schedule``: on which training steps the plan is in force and how strongly (a step at strength ``s`` keeps
      ``n − s·(n − k)`` of a layer's ``n`` pairs where the plan keeps ``k``). ``"constant"``: the plan on every
      step. ``"mixed"``: the plan for the first ``1 − exact_fraction`` of ``total_steps``, exact after (Zhu et
      al.'s schedule, for every op kind). ``"anneal"``: the keep-ratios raised from the plan's toward 1 in eight
      stages over the same steps, exact after. ``"noise"``: the guard estimates the gradient noise scale from
      the exact gradients of two consecutive checked steps and raises the keep-ratios (down to exact) as it
      grows (needs ``check_every``). ``None`` (default): ``"mixed"`` when ``total_steps`` is given, else
      ``"constant"``. A numeric ``budget`` is what a step at full strength executes; the plan and the report
      show the whole run's FLOPs.
    - ``total_steps``: the number of training steps (forward calls of the model in training mode with
      approximation on) the run will take, as a learning-rate schedule has; ``None``: not known.
    - ``exact_fraction``: ``"mixed"`` and ``"anneal"``: the share of ``total_steps`` trained exactly at the end.

    Saved activations (used when ``memory_budget < 1`` or ``activation_bits`` is set):

    - ``activation_bits``: store every eligible saved value at this many bits
      (2, 4 or 8; 32 routes them through the hooks uncompressed) instead of
      letting ``memory_budget`` choose.
    - ``activation_group_size``: elements per quantisation group (one bf16 offset
      and step each); a multiple of 8. Groups stay inside a value's feature rows (the last
      dimension of a 2-d or 3-d value, a channels-last map's channels): where it
      does not divide the row length, a longer row's smallest divisor above it (up to 4x), a shorter row
      itself (at least 64 elements).
    - ``activation_rounding``: ``"stochastic"`` (unbiased, default) or ``"nearest"``.
    - ``activation_min_bytes``: saved values smaller than this stay as they are.
    - ``activation_policy``: how ``memory_budget`` picks each value's bits: ``"measured"``
      (default: each value's gradient cost at 8/4/2 bits is measured on the example
      batch and the budget is met with the least predicted error) or ``"width"``
      (widest values lowered first, one step at a time: even widths).
    - ``activation_recompute``: rebuild saved values in backward from another value's
      copy instead of storing them. ``True``: the outputs of LayerNorm, GELU and other
      cheap elementwise ops whose input is saved anyway (their bytes drop out of the plan;
      the pair is measured together). ``"linear"``: also plain ``nn.Linear`` outputs whose
      input is stored or rebuilt (a feed-forward block's first Linear and GELU from the
      residual stream's copy: one more GEMM in backward for the largest saved value).
      ``"auto"`` (default): ``"linear"`` only when the budget cannot be met otherwise with
      every value at 8 bits or more, else ``True``. ``False``: nothing is rebuilt.
    - ``activation_checkpoint``: let ``memory_budget`` checkpoint whole blocks (the items of a
      container: transformer layers, ResNet bottlenecks) — keep only their inputs and run them
      again in backward (the re-run holding its values exact, or as 8-bit copies where the budget
      needs it) — where that is predicted to cost less step time than compressing what they save
      (each block's forward and the packer are timed on the example batch). ``False``: values
      only. In a region-captured model the blocks are its eager container items holding regions
      (a Hugging Face decoder layer), checkpointed by their module, their re-run exact.
    - ``activation_replan_every``: with a ``memory_budget``, choose the widths again every
      this many training steps, measured on that step's batch and the current weights
      (``ApproxGraphModule.replan_memory``); ``None`` (default) plans once.
    - ``activation_compile``: pack and unpack with ``torch.compile``d kernels (the
      first training step compiles them, ~1 min on a laptop CPU); ``False`` runs
      the same code eagerly.

    LSTM layers (``docs/lstm.md``):

    - ``lstm_granularity``: ``"coarse"`` (default: the same kept gate columns for the
      whole batch at each step, so the backward GEMMs shrink) or ``"fine"`` (each row
      keeps its own top-k; more faithful, not faster) for LSTM sparse backward.
    - ``lstm_block_steps``: coarse-grained, how many time steps share one choice of kept gate columns
      (chosen by the block's first step in backward order); the block's input and weight gradients are then
      one product each. 1 chooses at every step (see :class:`fxapprox.ops.lstm.LSTMBackward`).

    Example::

        >>> cfg = ApproxConfig(overrides=(LayerOverride("fc", exclude=True),), min_channels=64)
        >>> approx = fxapprox.approximate(model, 0.5, config=cfg)
        >>> ApproxConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    # -- tracing --------------------------------------------------------------------------------------------------
    leaf_modules: tuple[str | type, ...] = ()
    strict_trace: bool = False
    progress: bool = False
    # -- the compute plan -----------------------------------------------------------------------------------------
    policy: str = "measured"
    overrides: tuple[LayerOverride, ...] = ()
    keep_ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    max_grad_error: float | None = 0.3
    min_speedup: float | None = 1.05
    timing_cache: bool | str = True
    measure_repeats: int = 2
    error_draws: int = 3
    noise_horizon: float = 30.0
    keep_ratio: float = 0.5
    min_keep_ratio: float = 0.1
    min_channels: int = 16
    min_k: int = 4
    mode: str | None = None
    random_share: float = 0.05
    # -- row sampling ---------------------------------------------------------------------------------------------
    row_sampling: bool = True
    variance_tau: float = 0.025
    row_check_every: int | None = 100
    token_ratios: tuple[float, ...] = (1.0, 0.75, 0.5)
    max_forward_kl: float | None = 0.1
    # -- pay-off and the guard ------------------------------------------------------------------------------------
    min_gain: float | None = 1.05
    backward_error_cost: float = 1.6
    forward_error_cost: float = 0.6
    backward_tail_factor: float = 1.0
    forward_tail_factor: float = 0.15
    check_every: int | None = 50
    plan_check: bool = True
    divergence_error: float = 1.0
    check_replan: bool = True
    check_verbose: bool = True
    # -- the schedule over training -------------------------------------------------------------------------------
    schedule: str | None = None
    total_steps: int | None = None
    exact_fraction: float = 0.25
    # -- saved activations ----------------------------------------------------------------------------------------
    activation_bits: int | None = None
    activation_group_size: int = 256
    activation_rounding: str = "stochastic"
    activation_min_bytes: int = 65536
    activation_policy: str = "measured"
    activation_recompute: bool | str = "auto"
    activation_checkpoint: bool = True
    activation_replan_every: int | None = None
    activation_compile: bool = True
    # -- LSTM layers ----------------------------------------------------------------------------------------------
    lstm_granularity: str = "coarse"
    lstm_block_steps: int = DEFAULT_BLOCK_STEPS

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def paper_recipe(cls, keep_ratio: float = 0.5, min_channels: int = 64, **kwargs) -> "ApproxConfig":
        """The papers' fixed recipes: every sampleable layer with ≥ ``min_channels`` at ``keep_ratio``.

        ``paper_recipe(0.5, min_channels=1024)`` is Adelman et al.'s ResNet-50 setting
        (50% sampling of the layers with ≥ 1024 channels); ``paper_recipe(0.5, 16)``
        is "every conv except the 3-channel stem at 0.5". The budget is then only
        reported against, not used for allocation.
        """
        return cls(policy="uniform", keep_ratio=keep_ratio, min_keep_ratio=min(keep_ratio, 0.1),
                   min_channels=min_channels, **kwargs)

    @property
    def schedule_kind(self) -> str:
        """The schedule in force: ``schedule``, or its default (``"mixed"`` with ``total_steps``, else
        ``"constant"``)."""
        if self.schedule is not None:
            return self.schedule
        return "mixed" if self.total_steps is not None else "constant"

    @property
    def error_costs(self) -> tuple[float, float]:
        """``(backward, forward)`` predicted extra steps per squared error of a sampled step under this config's
        schedule: ``backward_error_cost`` / ``forward_error_cost``, times the tail factors where the schedule ends
        with exact training."""
        if self.schedule_kind in ("mixed", "anneal"):
            return (self.backward_error_cost * self.backward_tail_factor,
                    self.forward_error_cost * self.forward_tail_factor)
        return self.backward_error_cost, self.forward_error_cost

    @property
    def candidate_modes(self) -> tuple[str, ...]:
        """The modes the measured policy tries when ``mode`` is ``None``."""
        return MODES

    def override_for(self, names: tuple[str, ...], module: nn.Module | None) -> LayerOverride | None:
        """The first override matching a layer, or ``None``."""
        for rule in self.overrides:
            if rule.matches(names, module):
                return rule
        return None

    def to_dict(self) -> dict:
        """A JSON-serialisable description, one key per field (module types as ``{"type": "module.Name"}``)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "ApproxConfig":
        """The config :meth:`to_dict` describes (a plan's ``config``, read back from JSON).

        Module types are imported by their qualified name; a class that cannot be imported (defined inside a
        function) raises ``ValueError``: build that config in code instead.
        """
        if not isinstance(data, dict):
            raise TypeError(f"ApproxConfig.from_dict needs a dict, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise TypeError(f"ApproxConfig.from_dict: unknown field(s) {unknown}; the fields are {names}")
        values = {name: _from_plain(value) for name, value in data.items()}
        if "overrides" in values:
            values["overrides"] = tuple(rule if isinstance(rule, LayerOverride) else LayerOverride(**rule)
                                        for rule in values["overrides"])
        return cls(**values)


def _plain(value):
    """``value`` as JSON data: module types by qualified name, overrides as dicts of their fields, tuples as lists."""
    if isinstance(value, type):
        return {"type": f"{value.__module__}.{value.__qualname__}"}
    if isinstance(value, LayerOverride):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _from_plain(value):
    """The inverse of :func:`_plain` (lists as tuples, ``{"type": ...}`` imported; override dicts stay dicts)."""
    if isinstance(value, list):
        return tuple(_from_plain(v) for v in value)
    if isinstance(value, dict) and set(value) == {"type"}:
        return _import_type(value["type"])
    if isinstance(value, dict):
        return {k: _from_plain(v) for k, v in value.items()}
    return value


def _import_type(qualified: str) -> type:
    module_name, _, name = qualified.rpartition(".")
    try:
        value = importlib.import_module(module_name)
        for part in name.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError):
        value = None
    if not isinstance(value, type) or "<locals>" in qualified:
        raise ValueError(f"ApproxConfig.from_dict: cannot import the module type {qualified!r}; build a config "
                         f"naming it in code")
    return value
