"""The budget contract: a number is spent (counted by ``FlopCounterMode`` over a real step), ``"auto"`` is the
default, plans are reproducible, and the guard is silent on exact plans."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxapprox
from fxapprox.pipeline._projection import projection_loss
from fxapprox.pipeline.timing_cache import TimingCache

BUDGET = 0.5
SLACK = 0.05


def executed_fraction(model: nn.Module, approx: nn.Module, inputs) -> float:
    """FLOPs of one training step of ``approx`` (forward and backward of its loss) over those of ``model``."""
    def step(module) -> int:
        with FlopCounterMode(display=False) as counter:
            out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
            loss = out.loss if getattr(out, "loss", None) is not None else projection_loss(out)
            loss.backward()
        module.zero_grad(set_to_none=True)
        return counter.get_total_flops()
    return step(approx) / step(model)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


@pytest.mark.parametrize("method", ["auto", "topk", "crs", "bernoulli", "wta_crs"])
def test_every_method_spends_the_budget_on_the_mlp(method):
    model, x = _mlp(), torch.randn(128, 256)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(x,), method=method)
    assert approx.plan.budget_met and approx.plan.achieved <= BUDGET + 1e-9, approx.plan.note
    assert executed_fraction(model, approx, (x,)) <= BUDGET + SLACK


def test_torchvision_resnet_spends_the_budget():
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(), torch.randn(4, 3, 64, 64)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(x,))
    assert approx.plan.budget_met, approx.plan.note
    assert executed_fraction(model.train(), approx, (x,)) <= BUDGET + SLACK


def test_timm_model_spends_the_budget():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10)
    x = torch.randn(4, 3, 64, 64)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=(x,))
    assert approx.plan.budget_met, approx.plan.note
    assert executed_fraction(model.train(), approx, (x,)) <= BUDGET + SLACK


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hugging_face_models_spend_the_budget(name):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("hierarchical capture of HF models is tested on transformers 5")
    from tests.test_hf_capture import build

    model, inputs = build(name)
    approx = fxapprox.approximate(model, BUDGET, example_inputs=inputs)
    assert approx.plan.budget_met, approx.plan.note
    assert executed_fraction(model, approx, inputs) <= BUDGET + SLACK


def test_out_of_reach_budget_names_the_layers_and_the_lowest_fraction():
    torch.manual_seed(0)
    # the stem (3 channels) and the head (10 outputs, 16 inputs) cannot be sampled far: 0.05 is out of reach
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    approx = fxapprox.approximate(model, 0.05, example_inputs=(torch.randn(4, 3, 16, 16),))
    plan = approx.plan
    assert not plan.budget_met and plan.achieved == pytest.approx(plan.lowest_reachable)
    assert "budget 0.05 not reachable" in plan.note and "reduces over 3 channels" in plan.note and "(1: 0)" in plan.note
    assert any("not reachable" in warning for warning in plan.warnings)
    assert "NOT met" in str(approx.report)


def test_auto_is_the_default_and_the_budget_advises():
    x = torch.randn(128, 256)
    default = fxapprox.approximate(_mlp(), example_inputs=(x,))
    assert default.plan.budget == "auto" and "budget auto" in default.plan.note
    spent = fxapprox.approximate(_mlp(), BUDGET, example_inputs=(x,))
    # a numeric budget carries what the pay-off model predicts for it and what "auto" would do instead
    assert spent.plan.auto_advice.startswith('budget="auto" would')
    assert spent.plan.predicted_speedup > 0 and spent.plan.predicted_steps >= 1
    assert spent.plan.measured_speedup > 0   # the planned step timed against the exact one on the example batch
    assert 'budget="auto" would' in str(spent.report)
    with pytest.raises(ValueError, match="numeric budget"):
        fxapprox.approximate(_mlp(), example_inputs=(x,), config=fxapprox.ApproxConfig(policy="flops"))


def test_plans_are_reproducible_with_timing_on(tmp_path):
    """The same model, batch and seed plan the same way run after run: timings come from the machine's cache
    after the first plan, and the error draws do not depend on whether the timing runs happened."""
    x = torch.randn(128, 256)
    config = fxapprox.ApproxConfig(timing_cache=str(tmp_path))
    plans = [fxapprox.approximate(_mlp(), BUDGET, example_inputs=(x,), config=config).plan for _ in range(3)]
    assert len({p.fingerprint() for p in plans}) == 1
    assert plans[0].layers == plans[2].layers   # timings and predictions too, not only the decisions
    assert list(tmp_path.glob("timings-*.json"))
    # without timing, errors alone decide: reproducible without any cache
    untimed = fxapprox.ApproxConfig(min_speedup=None, timing_cache=False)
    fingerprints = {fxapprox.approximate(_mlp(), BUDGET, example_inputs=(x,), config=untimed).plan.fingerprint()
                    for _ in range(2)}
    assert len(fingerprints) == 1


def test_timing_cache_round_trips_merges_and_ignores_other_machines(tmp_path):
    cpu = torch.device("cpu")
    first, second = TimingCache(tmp_path, cpu), TimingCache(tmp_path, cpu)
    first.put("a", {"seconds": 1.0})
    second.put("b", {"seconds": 2.0})
    first.save()
    second.save()   # merges with what the first wrote meanwhile
    again = TimingCache(tmp_path, cpu)
    assert again.get("a") == {"seconds": 1.0} and again.get("b") == {"seconds": 2.0}
    path = next(tmp_path.glob("timings-*.json"))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "machine": "another machine"}))
    assert TimingCache(tmp_path, cpu).get("a") is None
    assert TimingCache(None, cpu).get("a") is None   # timing_cache=False: nothing read or written
    with pytest.raises(TypeError, match="timing_cache"):
        fxapprox.ApproxConfig(timing_cache=1)


def test_the_guard_is_silent_on_exact_plans(capsys):
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    config = fxapprox.ApproxConfig(check_every=1, min_speedup=1e6)   # nothing is faster: "auto" trains exactly
    for budget in ("auto", 1.0):
        approx = fxapprox.approximate(_mlp(), budget, example_inputs=(x,), config=config)
        assert not approx.plan.approximated
        optimizer = torch.optim.SGD(approx.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(approx(x), y).backward()
            optimizer.step()
        assert len(approx.history) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


_PLAN_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {examples!r})
import fxapprox
from char_transformer import CharTransformer
torch.set_num_threads(1)
torch.manual_seed(0)
tokens = torch.randint(0, 50, (4, 32))
config = fxapprox.ApproxConfig(min_speedup=None, check_every=None, activation_min_bytes=0, timing_cache={cache!r},
                               progress=False)
approx = fxapprox.approximate(CharTransformer(50, 64, 2, 2, 32), 0.5, memory_budget=0.25, example_inputs=(tokens,),
                              config=config)
print(json.dumps(approx.plan.to_dict(), sort_keys=True, default=str))
"""


def test_plans_do_not_depend_on_the_hash_seed(tmp_path):
    """Sums and error draws in set order would make two runs of the same model, batch and seed plan differently
    (predicted errors one ulp apart, draws in another order): two processes with different PYTHONHASHSEED agree
    on every field of the plan that is not a timing (the memory plan's block timings come from one timing cache,
    written by the first)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _PLAN_SCRIPT.format(examples=str(Path(__file__).resolve().parents[1] / "examples"), cache=str(tmp_path))

    def plan_in_process(seed: str) -> dict:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from refactor_check import _strip_timings   # the refactor fingerprint's notion of "not a timing"

    first, second = (_strip_timings(plan_in_process(seed)) for seed in ("1", "2"))
    assert first["memory"]["values"], "the memory plan compressed nothing: the test would not see its errors"
    assert first == second
