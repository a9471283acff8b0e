"""Validation of :class:`~fxapprox.config.ApproxConfig`: every field checked on construction, an error naming the
field and what it accepts; tuples normalised (sorted, deduplicated) in place of the frozen instance's fields."""

from __future__ import annotations

import warnings

from torch import nn

from fxapprox._validate import check_choice, check_fraction, check_int, check_positive, check_share
from fxapprox.ops.quantize import ROUNDINGS
from fxapprox.pipeline.overrides import LayerOverride
from fxapprox.runtime.modules import MODES
from fxapprox.schedule import SCHEDULES

__all__ = ["ACTIVATION_BITS", "POLICIES", "validate"]

#: how the plan is made: least measured error for the FLOP budget ("measured"), the FLOP-ranked walk at one
#: common keep-ratio ("flops"), or every eligible layer at keep_ratio ("uniform")
POLICIES = ("measured", "flops", "uniform")
#: widths ``activation_bits`` accepts (32: through the hooks, uncompressed)
ACTIVATION_BITS = (2, 4, 8, 32)


def validate(config) -> None:
    """Check every field of ``config`` (an ``ApproxConfig`` being constructed); raise ``TypeError`` or
    ``ValueError`` naming the field and its allowed values."""
    if isinstance(config.leaf_modules, (str, type)) or not isinstance(config.leaf_modules, (tuple, list)):
        raise TypeError(f"leaf_modules must be a tuple of module names or types, got {config.leaf_modules!r}")
    for leaf in config.leaf_modules:
        if not (isinstance(leaf, str) or (isinstance(leaf, type) and issubclass(leaf, nn.Module))):
            raise TypeError(f"leaf_modules entries must be str or nn.Module subclasses, got {leaf!r}")
    object.__setattr__(config, "leaf_modules", tuple(config.leaf_modules))
    if not isinstance(config.strict_trace, bool):
        raise TypeError(f"strict_trace must be a bool, got {config.strict_trace!r}")
    if not isinstance(config.overrides, (tuple, list)):
        raise TypeError(f"overrides must be a tuple of LayerOverride, got {config.overrides!r}")
    for rule in config.overrides:
        if not isinstance(rule, LayerOverride):
            raise TypeError(f"overrides entries must be LayerOverride, got {rule!r}")
    object.__setattr__(config, "overrides", tuple(config.overrides))
    check_fraction("keep_ratio", config.keep_ratio)
    check_fraction("min_keep_ratio", config.min_keep_ratio)
    if config.min_keep_ratio > config.keep_ratio:
        raise ValueError(f"min_keep_ratio ({config.min_keep_ratio}) must be <= keep_ratio ({config.keep_ratio})")
    check_int("min_channels", config.min_channels, minimum=1)
    check_int("min_k", config.min_k, minimum=1)
    if config.mode is not None:
        check_choice("mode", config.mode, MODES)
    check_share("random_share", config.random_share)
    if config.policy == "budget":
        warnings.warn('ApproxConfig(policy="budget") is now called policy="flops"', DeprecationWarning,
                      stacklevel=3)
        object.__setattr__(config, "policy", "flops")
    check_choice("policy", config.policy, POLICIES)
    if isinstance(config.keep_ratios, (int, float)) or not isinstance(config.keep_ratios, (tuple, list)) \
            or not config.keep_ratios:
        raise TypeError(f"keep_ratios must be a non-empty tuple of keep-ratios in (0, 1), got {config.keep_ratios!r}")
    for ratio in config.keep_ratios:
        if check_fraction("keep_ratios entries", ratio) >= 1.0:
            raise ValueError(f"keep_ratios entries must be in (0, 1), got {ratio!r}")
    object.__setattr__(config, "keep_ratios", tuple(sorted(float(r) for r in set(config.keep_ratios))))
    if config.max_grad_error is not None:
        check_positive("max_grad_error", config.max_grad_error)
    if config.min_speedup is not None:
        check_positive("min_speedup", config.min_speedup)
    if not isinstance(config.timing_cache, (bool, str)):
        raise TypeError(f"timing_cache must be True, False or a directory path, got {config.timing_cache!r}")
    check_int("measure_repeats", config.measure_repeats, minimum=1)
    check_int("error_draws", config.error_draws, minimum=1)
    if check_positive("noise_horizon", config.noise_horizon) < 1.0:
        raise ValueError(f"noise_horizon must be >= 1, got {config.noise_horizon!r}")
    if not isinstance(config.progress, bool):
        raise TypeError(f"progress must be a bool, got {config.progress!r}")
    check_choice("lstm_granularity", config.lstm_granularity, ("coarse", "fine"))
    check_int("lstm_block_steps", config.lstm_block_steps, minimum=1)
    if config.activation_bits is not None:
        check_int("activation_bits", config.activation_bits, minimum=1)
        if config.activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS} or None, "
                             f"got {config.activation_bits!r}")
    check_int("activation_group_size", config.activation_group_size, minimum=8)
    if config.activation_group_size % 8:
        raise ValueError(f"activation_group_size must be a multiple of 8, got {config.activation_group_size!r}")
    check_choice("activation_rounding", config.activation_rounding, ROUNDINGS)
    check_int("activation_min_bytes", config.activation_min_bytes, minimum=0)
    if not isinstance(config.activation_checkpoint, bool):
        raise TypeError(f"activation_checkpoint must be a bool, got {config.activation_checkpoint!r}")
    if not isinstance(config.activation_compile, bool):
        raise TypeError(f"activation_compile must be a bool, got {config.activation_compile!r}")
    check_choice("activation_policy", config.activation_policy, ("measured", "width"))
    if config.activation_replan_every is not None:
        check_int("activation_replan_every", config.activation_replan_every, minimum=1)
    check_positive("backward_error_cost", config.backward_error_cost)
    check_positive("forward_error_cost", config.forward_error_cost)
    for name in ("backward_tail_factor", "forward_tail_factor"):
        value = getattr(config, name)
        if check_positive(name, value) > 1.0:
            raise ValueError(f"{name} must be in (0, 1] (the share of the extra steps an exact tail leaves), "
                             f"got {value!r}")
    if not isinstance(config.row_sampling, bool):
        raise TypeError(f"row_sampling must be a bool, got {config.row_sampling!r}")
    check_positive("variance_tau", config.variance_tau)
    if config.row_check_every is not None:
        check_int("row_check_every", config.row_check_every, minimum=1)
    if isinstance(config.token_ratios, (int, float)) or not isinstance(config.token_ratios, (tuple, list)) \
            or not config.token_ratios:
        raise TypeError(f"token_ratios must be a non-empty tuple of shares in (0, 1], got {config.token_ratios!r}")
    for ratio in config.token_ratios:
        check_fraction("token_ratios entries", ratio)
    object.__setattr__(config, "token_ratios", tuple(sorted({float(r) for r in config.token_ratios}, reverse=True)))
    if config.max_forward_kl is not None:
        check_positive("max_forward_kl", config.max_forward_kl)
    if config.min_gain is not None:
        check_positive("min_gain", config.min_gain)
    if config.check_every is not None:
        check_int("check_every", config.check_every, minimum=1)
    check_positive("divergence_error", config.divergence_error)
    for name in ("check_replan", "check_verbose", "plan_check"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(config, name)!r}")
    if config.schedule is not None:
        check_choice("schedule", config.schedule, SCHEDULES)
    if config.total_steps is not None:
        check_int("total_steps", config.total_steps, minimum=1)
    check_share("exact_fraction", config.exact_fraction)
    if config.schedule in ("mixed", "anneal") and config.total_steps is None:
        raise ValueError(f"schedule={config.schedule!r} needs total_steps=N, the number of training steps of the "
                         f"run (its exact tail is the last exact_fraction of them)")
    if config.schedule == "noise" and config.check_every is None:
        raise ValueError("schedule='noise' measures the gradient noise scale at the guard's checks: set "
                         "check_every (e.g. 50), or choose schedule='mixed' or 'anneal'")
    if not (isinstance(config.activation_recompute, bool) or config.activation_recompute in ("linear", "auto")):
        raise ValueError("activation_recompute must be True, False, 'linear' or 'auto', got "
                         f"{config.activation_recompute!r}")
