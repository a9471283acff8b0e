"""The guard (``ApproxConfig(check_every=N)``): measured gradient error during training, re-planning, history."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox import ApproxConfig, LayerOverride
from fxapprox.runtime.guard import TrainingHistory, gradient_errors, owner_groups


def _mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(dropout), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def _data(batch: int = 128):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, 256, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


def _train(approx, x, y, steps: int, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(approx.parameters(), 0.05, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(approx(x), y).backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("mode", ["forward", "backward", "weight_grad"])
def test_guard_measures_zero_error_at_keep_ratio_one(mode):
    x, y = _data()
    config = ApproxConfig(policy="flops", min_channels=8, min_gain=None, check_every=1, check_verbose=False,
                          overrides=(LayerOverride(r".*", mode=mode, method="topk" if mode == "forward" else "crs",
                                                   keep_ratio=0.5),))
    approx = fxapprox.approximate(_mlp(dropout=0.2), 0.99, example_inputs=(x,), config=config)
    sampled = [m for m in approx.modules() if hasattr(m, "fxapprox_spec")]
    assert sampled and approx.plan.approximated
    for module in sampled:   # keep every row / column: the sampled ops equal the exact ones
        module.fxapprox_spec = dataclasses.replace(module.fxapprox_spec, k=module.fxapprox_spec.n)
    _train(approx, x, y, 3)
    assert len(approx.history) == 3
    for record in approx.history:
        assert record.model_error < 1e-5   # dropout draws the same masks in the reference pass
        assert record.backward_error < 1e-5 and record.output_error < 1e-6
        assert record.alignment == pytest.approx(1.0, abs=1e-5)
        assert record.action == "kept"


def test_guard_measures_the_error_of_a_sampled_plan():
    x, y = _data()
    config = ApproxConfig(min_speedup=None, min_gain=None, max_grad_error=0.5, min_channels=8, mode="backward",
                          check_every=1, check_replan=False, check_verbose=False)
    approx = fxapprox.approximate(_mlp(), 0.5, example_inputs=(x,), config=config)
    _train(approx, x, y, 2)
    record = approx.history[0]
    assert record.model_error > 0.05 and record.backward_error == pytest.approx(record.model_error)
    sampled = [layer for layer in record.layers if layer.measured_error is not None]
    assert sampled and all(layer.measured_error > 0 for layer in sampled)
    # the model's gradients are unchanged by the check: the user's step saw the approximate gradient only
    assert record.cosine < 1.0


@pytest.mark.parametrize("budget, mode", [("auto", "backward"), ("auto", "forward"), (0.5, "backward"),
                                          (0.5, "forward")])
def test_layer_past_the_threshold_is_replanned_and_error_falls(budget, mode):
    """``"auto"`` is held to max_grad_error; a numeric budget only to divergence_error (the user chose the FLOPs),
    and its check records how far from the budget the re-plan moved the plan."""
    x, y = _data()
    # "auto" with errors that cost (almost) no steps: it samples as a budget would
    costs = dict(backward_error_cost=1e-6, forward_error_cost=1e-6) if budget == "auto" else {}
    config = ApproxConfig(min_speedup=None, min_gain=1.05 if budget == "auto" else None, max_grad_error=0.5,
                          min_channels=8, mode=mode, check_every=2, check_verbose=False, **costs)
    approx = fxapprox.approximate(_mlp(), budget, example_inputs=(x,), config=config)
    before = approx.plan
    assert before.approximated
    if budget != "auto":   # a tolerance the plan passes is not a reason to move off the user's budget
        approx._fxapprox_state.config = dataclasses.replace(config, max_grad_error=1e-3)
        _train(approx, x, y, 2)
        assert approx.history[0].action == "kept" and "below divergence_error" in approx.history[0].note
        assert approx.plan == before
    # Training turns out stricter than planning: the threshold the checks hold the plan to is lowered.
    threshold = "max_grad_error" if budget == "auto" else "divergence_error"
    approx._fxapprox_state.config = dataclasses.replace(config, **{threshold: 0.3})
    params = {name: id(p) for name, p in approx.named_parameters()}
    keys = list(approx.state_dict())
    optimizer = _train(approx, x, y, 2)
    first = next(r for r in approx.history if r.action == "replanned")
    assert threshold in first.note
    if budget != "auto":
        assert f"the plan moved from {before.achieved:.3f} to {approx.plan.achieved:.3f}" in first.note
    assert approx.plan.total_planned_flops > before.total_planned_flops
    assert f"re-planned at step {first.step}" in approx.plan.note
    state_before = {id(p): s["momentum_buffer"].clone() for p, s in optimizer.state.items()}
    _train(approx, x, y, 4, optimizer)
    assert {name: id(p) for name, p in approx.named_parameters()} == params
    assert list(approx.state_dict()) == keys
    assert set(state_before) == {id(p) for p in optimizer.state} == set(params.values())
    later = approx.history[approx.history.records.index(first) + 1:]
    if approx.plan.approximated:   # still sampled: the checks go on and measure less error
        assert later and all(r.model_error < first.model_error for r in later)
    else:   # re-planned to exact: every sampled module keeps all its pairs, nothing is left to check
        assert not later
        specs = [m.fxapprox_spec for m in approx.modules() if hasattr(m, "fxapprox_spec")]
        assert specs and all(spec.k == spec.n for spec in specs)
    # the model still loads back into the original architecture
    _mlp().load_state_dict(approx.state_dict())


def test_history_round_trips_through_json():
    x, y = _data()
    config = ApproxConfig(min_speedup=None, min_gain=None, max_grad_error=0.5, min_channels=8, check_every=1,
                          check_verbose=False)
    approx = fxapprox.approximate(_mlp(), 0.5, example_inputs=(x,), config=config)
    _train(approx, x, y, 2)
    data = json.loads(approx.history.to_json())
    assert [r["step"] for r in data["records"]] == [1, 2]
    again = TrainingHistory.from_dict(data)
    assert again.to_dict() == approx.history.to_dict()
    assert again[0].layers == approx.history[0].layers
    assert "2 check(s)" in str(approx.report)   # the summary's guard line
    text = approx.report.text(verbose=True)   # the last check, predicted beside measured per layer
    assert "guard: 2 check(s)" in text and "measured error (in the model)" in text
    assert json.loads(json.dumps(approx.report.to_dict()["history"])) == data


def test_guard_off_and_unfinished_steps():
    x, y = _data()
    off = fxapprox.approximate(_mlp(), 0.5, example_inputs=(x,),
                               config=ApproxConfig(policy="flops", min_channels=8, check_every=None))
    _train(off, x, y, 2)
    assert len(off.history) == 0
    on = fxapprox.approximate(_mlp(), 0.5, example_inputs=(x,),
                              config=ApproxConfig(policy="flops", min_channels=8, check_every=1, check_verbose=False))
    on(x)   # a training-mode forward whose backward never runs: its check is dropped at the next step
    _train(on, x, y, 1)
    assert [r.step for r in on.history] == [2]
    with torch.no_grad():
        on(x)
    on.eval()
    on(x)
    assert len(on.history) == 1


def test_budget_auto_keeps_the_model_exact_when_nothing_is_faster():
    x, _ = _data()
    approx = fxapprox.approximate(_mlp(), "auto", example_inputs=(x,),
                                  config=ApproxConfig(min_speedup=1e6, min_channels=8, check_verbose=False))
    assert approx.plan.budget == "auto"
    assert not approx.plan.approximated
    assert approx.plan.total_planned_flops == approx.plan.total_exact_flops
    assert "auto" in approx.plan.note


def test_budget_auto_needs_the_measured_policy():
    with pytest.raises(ValueError, match="auto"):
        fxapprox.approximate(_mlp(), "auto", example_inputs=(_data()[0],), config=ApproxConfig(policy="flops"))


def test_gradient_errors_per_owner():
    exact = {"a.weight": torch.ones(4), "a.bias": torch.ones(1), "b.weight": torch.ones(2), "c.weight": torch.zeros(3)}
    approx = {"a.weight": torch.ones(4), "a.bias": torch.ones(1), "b.weight": None, "c.weight": torch.ones(3)}
    model, errors = gradient_errors(exact, approx, owner_groups(exact))
    assert errors == {"a": 0.0, "b": 1.0}   # c: zero exact gradient, left out; b: missing gradient counts as 0
    assert model == pytest.approx((0.5) ** 0.5)


@pytest.mark.parametrize("field, value", [("check_every", 0), ("check_every", 1.5), ("backward_error_cost", -1.0),
                                          ("forward_error_cost", 0.0), ("min_gain", 0.0), ("check_replan", "yes")])
def test_config_rejects_bad_guard_settings(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        ApproxConfig(**{field: value})
