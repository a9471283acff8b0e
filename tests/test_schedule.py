"""Approximation schedules over training (``ApproxConfig(schedule=..., total_steps=N)``, ``fxapprox.schedule``)."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig, LayerOverride
from fxapprox.plan import Plan
from fxapprox.schedule import ANNEAL_STAGES, NoiseScale, ScheduleRecord, schedule_strength, whole_run_fraction


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _data(batch: int = 64, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 256, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


def _approx(schedule, total_steps=8, mode="backward", **kwargs):
    x, _ = _data()
    config = ApproxConfig(schedule=schedule, total_steps=total_steps, min_speedup=None, min_gain=None,
                          check_verbose=False, min_channels=8,
                          overrides=(LayerOverride(r".*", mode=mode, method="topk" if mode == "forward" else "crs",
                                                   keep_ratio=0.5),), **kwargs)
    return fxapprox.approximate(_mlp(), 0.99, example_inputs=(x,), config=config)


def _kept(approx) -> tuple:
    return tuple(m.fxapprox_spec.k for m in approx.modules() if hasattr(m, "fxapprox_spec"))


def _step(approx, optimizer, x, y):
    optimizer.zero_grad()
    F.cross_entropy(approx(x), y).backward()
    optimizer.step()


# -- the config --------------------------------------------------------------------------------------------------
def test_default_schedule_is_mixed_with_total_steps_else_constant():
    assert ApproxConfig().schedule_kind == "constant"
    assert ApproxConfig(total_steps=100).schedule_kind == "mixed"
    assert ApproxConfig(schedule="anneal", total_steps=100).schedule_kind == "anneal"
    config = ApproxConfig(schedule="noise", total_steps=100, exact_fraction=0.5)
    assert ApproxConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "cosine"}, "schedule must be one of"),
    ({"schedule": "mixed"}, "needs total_steps"),
    ({"schedule": "anneal"}, "needs total_steps"),
    ({"schedule": "noise", "check_every": None}, "check_every"),
    ({"total_steps": 0}, "total_steps must be an integer >= 1"),
    ({"exact_fraction": 1.0}, r"exact_fraction must be in \[0, 1\)"),
    ({"exact_fraction": -0.1}, "exact_fraction must be in"),
])
def test_config_rejects_bad_schedules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ApproxConfig(**kwargs)


# -- step-driven schedules -----------------------------------------------------------------------------------------
def test_strengths_of_the_step_driven_schedules():
    assert [schedule_strength("mixed", s, 8, 0.25) for s in range(1, 9)] == [1] * 6 + [0] * 2
    assert [schedule_strength("constant", s, 8, 0.25) for s in range(1, 9)] == [1] * 8
    anneal = [schedule_strength("anneal", s, 100, 0.2) for s in range(1, 101)]
    assert anneal[0] == 1.0 and anneal[79] > 0 and anneal[80:] == [0.0] * 20
    assert all(a >= b for a, b in zip(anneal, anneal[1:]))
    assert len(set(anneal)) == ANNEAL_STAGES + 1
    # a step at strength s executes 1 − s·(1 − achieved): the mixed run's mean over its steps
    assert whole_run_fraction("mixed", 8, 0.25, 0.5) == pytest.approx((6 * 0.5 + 2) / 8)
    assert whole_run_fraction("constant", None, 0.25, 0.5) == 0.5
    assert whole_run_fraction("noise", 8, 0.25, 0.5) is None


@pytest.mark.parametrize("mode", ["forward", "backward", "weight_grad"])
def test_mixed_schedule_trains_exactly_after_its_sampled_steps(mode):
    x, y = _data()
    approx = _approx("mixed", total_steps=8, mode=mode)
    exact = copy.deepcopy(_mlp())
    planned = _kept(approx)
    sampled = [m for m in approx.modules() if hasattr(m, "fxapprox_spec") and m.fxapprox_spec.k < m.fxapprox_spec.n]
    assert approx.plan.approximated and len(sampled) == len(approx.plan.approximated)
    optimizer = torch.optim.SGD(approx.parameters(), 0.05)
    for _ in range(6):
        _step(approx, optimizer, x, y)
        assert _kept(approx) == planned
    exact.load_state_dict(approx.state_dict())
    for _ in range(2):   # steps 7 and 8: every layer keeps all its pairs; output and gradients are exact
        approx.zero_grad()
        out = approx(x)
        assert _kept(approx) == tuple(m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec"))
        F.cross_entropy(out, y).backward()
        exact.zero_grad()
        reference = exact(x)
        F.cross_entropy(reference, y).backward()
        torch.testing.assert_close(out, reference)
        for (name, p), q in zip(approx.named_parameters(), exact.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert approx.executed_flops == pytest.approx(approx.plan.schedule["whole_run_flops"])
    assert approx.executed_flops == pytest.approx((6 * approx.plan.achieved + 2) / 8)


def test_anneal_raises_keep_ratios_toward_one_and_ends_exact():
    x, y = _data()
    approx = _approx("anneal", total_steps=32, exact_fraction=0.25)
    optimizer = torch.optim.SGD(approx.parameters(), 0.05)
    kept = []
    for _ in range(32):
        _step(approx, optimizer, x, y)
        kept.append(_kept(approx))
    full = tuple(m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec"))
    assert kept[0] != full and kept[-1] == full and kept[23] != full and kept[24] == full
    for before, after in zip(kept, kept[1:]):
        assert all(a >= b for a, b in zip(after, before))
    assert len(set(kept)) == ANNEAL_STAGES + 1
    assert approx.executed_flops == pytest.approx(approx.plan.schedule["whole_run_flops"], rel=1e-3)


def test_switches_keep_parameters_state_dict_and_optimizer_state():
    x, y = _data()
    approx = _approx("mixed", total_steps=4, exact_fraction=0.5)
    parameters = {name: p for name, p in approx.named_parameters()}
    keys = list(approx.state_dict())
    optimizer = torch.optim.Adam(approx.parameters(), 1e-3)
    for _ in range(4):
        _step(approx, optimizer, x, y)
        assert {name: p for name, p in approx.named_parameters()} == parameters
        assert list(approx.state_dict()) == keys
    assert set(optimizer.state) == set(parameters.values())   # one Adam state per parameter, the same objects
    _mlp().load_state_dict(approx.state_dict())   # the weights still load into the original model


def test_set_approximate_off_wins_over_the_schedule():
    x, y = _data()
    approx = _approx("mixed", total_steps=8)
    optimizer = torch.optim.SGD(approx.parameters(), 0.05)
    _step(approx, optimizer, x, y)   # a sampled step: the schedule at full strength
    exact = _mlp()
    exact.load_state_dict(approx.state_dict())
    approx.set_approximate(False)
    torch.testing.assert_close(approx(x), exact(x))   # still within the sampled steps, yet exact
    approx.set_approximate(True)
    assert _kept(approx) != tuple(m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec"))


def test_the_exact_tail_is_rounded_up():
    from fxapprox.schedule import sampled_steps

    assert [sampled_steps(n, 0.25) for n in (2, 6, 8, 10, 1000)] == [1, 4, 6, 7, 750]
    assert sampled_steps(100, 0.2) == 80 and sampled_steps(5, 0.0) == 5


def test_plan_and_report_show_the_schedule():
    approx = _approx("mixed", total_steps=1000)
    plan = approx.plan
    assert plan.schedule["kind"] == "mixed" and plan.schedule["sampled_steps"] == 750
    assert plan.schedule["whole_run_flops"] == pytest.approx(0.75 * plan.achieved + 0.25)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).schedule == plan.schedule
    text = approx.report.text()
    assert "mixed over 1000 steps: the plan for steps 1–750, exact after" in text
    assert f"whole run {plan.schedule['whole_run_flops']:.3f}" in text
    # the schedule is part of what the plan does
    assert _approx("anneal", total_steps=1000).plan.fingerprint() != plan.fingerprint()
    assert _approx("mixed", total_steps=1000).plan.fingerprint() == plan.fingerprint()
    assert ScheduleRecord(**plan.schedule).describe().startswith("mixed over 1000 steps")


def test_a_constant_plan_without_total_steps_has_no_schedule_row():
    approx = _approx(None, total_steps=None)
    assert approx.plan.schedule["kind"] == "constant"
    assert "schedule " not in (approx.report.text())


# -- the measured schedule -----------------------------------------------------------------------------------------
def _gradient_pairs(signal: float, noise: float, batch: int, pairs: int, size: int = 4000):
    """Pairs of minibatch gradients g = G + ε/√B with |G|² = signal·size and tr Σ = noise·size."""
    generator = torch.Generator().manual_seed(0)
    G = torch.randn(size, generator=generator, dtype=torch.float64)
    G *= math.sqrt(signal * size) / G.norm()
    for _ in range(pairs):
        a = G + math.sqrt(noise / batch) * torch.randn(size, generator=generator, dtype=torch.float64)
        b = G + math.sqrt(noise / batch) * torch.randn(size, generator=generator, dtype=torch.float64)
        yield float(a @ b), 0.5 * float(a @ a + b @ b)


@pytest.mark.parametrize("signal, noise, batch", [(1.0, 8.0, 32), (1.0, 64.0, 32), (0.5, 64.0, 16)])
def test_noise_scale_estimates_b_noise_over_b(signal, noise, batch):
    estimate = NoiseScale(decay=0.9)
    for inner, squares in _gradient_pairs(signal, noise, batch, pairs=200):
        estimate.update(inner, squares)
    expected = noise / signal / batch   # B_noise / B = tr Σ / (B |G|²)
    assert estimate.ratio == pytest.approx(expected, rel=0.25)


def test_noise_schedule_raises_keep_ratios_as_the_noise_scale_grows():
    # with the plan 1.4x faster per step at half the FLOPs: sample while B_noise/B is small, less as it grows,
    # exact once the extra steps outweigh the speed
    levels = []
    for ratio in (0.01, 0.3, 0.6, 5.0, math.inf):
        estimate = NoiseScale()
        estimate.signal, estimate.total = 1.0, 1.0 + ratio
        levels.append(estimate.strength(1.0, speedup=1.4, achieved=0.5))
    assert levels == [1.0, 1.0, 0.75, 0.0, 0.0]
    # the strength never rises again
    estimate = NoiseScale()
    estimate.signal, estimate.total = 1.0, 1.01
    assert estimate.strength(0.25, speedup=1.4, achieved=0.5) == 0.25


def test_noise_schedule_measures_on_paired_checks_and_goes_exact_on_pure_noise():
    # labels drawn afresh every step: the gradients of two batches share almost nothing, B_noise/B is large
    approx = _approx("noise", total_steps=None, mode="backward", check_every=4)
    optimizer = torch.optim.SGD(approx.parameters(), 0.01)
    x, _ = _data(batch=8)
    generator = torch.Generator().manual_seed(5)
    for _ in range(9):
        _step(approx, optimizer, torch.randn(8, 256, generator=generator),
              torch.randint(0, 10, (8,), generator=generator))
    # checked in pairs (steps 4 and 5); exact from step 6 on, so no more checks
    assert [r.step for r in approx.history] == [4, 5]
    measured = [r for r in approx.history if r.noise_scale is not None]
    assert [r.step for r in measured] == [5]
    assert measured[0].noise_scale > 1.0 and measured[0].strength == 0.0
    assert approx._fxapprox_state.strength == 0.0 and "strength 1 → 0" in measured[0].note
    full = tuple(m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec"))
    assert _kept(approx) == full
    before = len(approx.history)
    _step(approx, optimizer, x, torch.zeros(8, dtype=torch.long))
    assert len(approx.history) == before   # nothing sampled: no more checks


def test_mixed_schedule_on_a_model_captured_region_by_region():
    from tests.test_untraceable_blocks import CharLM, UnpackingBlock, VOCAB, T

    torch.manual_seed(0)
    model = CharLM(UnpackingBlock, blocks=2)
    ids = torch.randint(0, VOCAB, (8, T))
    config = ApproxConfig(total_steps=4, exact_fraction=0.5, min_speedup=None, min_gain=None, check_verbose=False)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(ids,), config=config)
    assert approx.plan.untraced and approx.plan.approximated and approx.plan.schedule["kind"] == "mixed"
    optimizer = torch.optim.SGD(approx.parameters(), 0.01)
    kept = []
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(approx(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        kept.append([m.fxapprox_spec.k < m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec")])
    assert any(kept[0]) and any(kept[1]) and not any(kept[2]) and not any(kept[3])


def test_error_costs_follow_the_phase_the_errors_fall_in():
    constant = ApproxConfig()
    assert constant.error_costs == (constant.backward_error_cost, constant.forward_error_cost)
    mixed = ApproxConfig(total_steps=100, forward_tail_factor=0.2, backward_tail_factor=0.9)
    assert mixed.error_costs == pytest.approx((0.9 * mixed.backward_error_cost, 0.2 * mixed.forward_error_cost))
    assert ApproxConfig(schedule="noise", total_steps=100).error_costs == constant.error_costs
    for value in (0.0, 1.5):
        with pytest.raises(ValueError, match="forward_tail_factor"):
            ApproxConfig(forward_tail_factor=value)


def test_a_compiled_model_follows_its_schedule():
    x, y = _data()
    approx = _approx("mixed", total_steps=4, exact_fraction=0.5)
    compiled = torch.compile(approx, backend="eager")
    optimizer = torch.optim.SGD(approx.parameters(), 0.05)
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        optimizer.step()
    assert approx._fxapprox_state.training_steps == 4
    assert _kept(approx) == tuple(m.fxapprox_spec.n for m in approx.modules() if hasattr(m, "fxapprox_spec"))
    assert approx.executed_flops == pytest.approx((2 * approx.plan.achieved + 2) / 4)


@pytest.mark.parametrize("kind", ["mixed", "anneal"])
@pytest.mark.parametrize("steps, exact_fraction", [(8, 0.25), (32, 0.25), (100, 0.2), (7, 0.5), (3, 0.0), (1000, 0.3)])
def test_whole_run_flops_are_the_mean_of_the_steps(kind, steps, exact_fraction):
    from fxapprox.schedule import step_fraction

    per_step = [step_fraction(schedule_strength(kind, s, steps, exact_fraction), 0.4) for s in range(1, steps + 1)]
    assert whole_run_fraction(kind, steps, exact_fraction, 0.4) == pytest.approx(sum(per_step) / steps, abs=1e-12)
