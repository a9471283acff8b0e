"""fxapprox.bench and `fxapprox bench`: fields, fidelity at budget 1.0 and below it, validation."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxapprox
from fxapprox.cli import main

FIELDS = {"exact_step_s", "approx_step_s", "speedup", "exact_mem_mib", "approx_mem_mib", "memory_ratio",
          "flops_planned", "flops_executed", "layers"}
LAYER_FIELDS = {"name", "method", "keep_ratio", "grad_cosine", "grad_rel_error"}


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TinyCNN()


@pytest.fixture
def inputs():
    return torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def test_budget_one_is_exact(inputs):
    result = fxapprox.bench(tiny_cnn(), inputs, budget=1.0, steps=2, warmup=0, progress=False)
    assert {layer.name for layer in result.layers} == {"conv1", "conv2", "fc"}
    for layer in result.layers:
        assert layer.method == "exact" and layer.keep_ratio == 1.0
        assert layer.grad_cosine == pytest.approx(1.0, abs=1e-9)
        assert layer.grad_rel_error == pytest.approx(0.0, abs=1e-9)
    assert result.flops_executed == result.flops_exact == result.flops_planned


def test_approximating_moves_gradients_and_halves_flops(inputs):
    result = fxapprox.bench(tiny_cnn(), inputs, budget=0.5, steps=2, warmup=0, progress=False,
                            config=fxapprox.ApproxConfig(policy="flops"))
    sampled = [layer for layer in result.layers if layer.method != "exact"]
    assert sampled and all(layer.keep_ratio < 1 for layer in sampled)
    assert all(layer.grad_cosine < 1.0 - 1e-6 and layer.grad_rel_error > 1e-6 for layer in sampled)
    # executed FLOPs are counted on the real approximated step, not copied from the plan
    assert result.flops_executed < 0.6 * result.flops_exact
    assert result.flops_executed == pytest.approx(result.flops_planned, rel=0.02)


def test_memory_budget_compresses_saved_activations():
    torch.manual_seed(0)
    big = torch.randn(64, 3, 16, 16)   # activations above the 64 KiB compression threshold
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    result = fxapprox.bench(model, big, budget=1.0, memory_budget=0.25, steps=1, warmup=0, progress=False)
    assert result.memory_ratio > 2.5
    assert result.exact_mem_mib > result.approx_mem_mib > 0
    # the compressed copies' predicted error is part of the prediction, not only the sampled layers'
    assert result.predicted_grad_error is not None and result.predicted_grad_error > 0
    assert result.grad_error > 0


def test_model_is_not_modified(inputs):
    model = tiny_cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxapprox.bench(model, inputs, budget=0.5, steps=1, warmup=0, progress=False,
                   config=fxapprox.ApproxConfig(policy="flops"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [({"budget": 0.0}, "budget"), ({"steps": 0}, "steps"),
                                             ({"memory_budget": 2.0}, "memory_budget"),
                                             ({"fidelity_samples": 0}, "fidelity_samples")])
def test_bad_arguments_name_themselves(inputs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fxapprox.bench(tiny_cnn(), inputs, progress=False, **kwargs)


def test_cli_json_has_every_field(capsys):
    code = main(["bench", "tests.test_bench:tiny_cnn", "--input-shape", "16,3,8,8", "--steps", "2", "--warmup",
                 "0", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert FIELDS <= set(data)
    assert data["layers"] and all(LAYER_FIELDS <= set(layer) for layer in data["layers"])
    assert data["speedup"] == pytest.approx(data["exact_step_s"] / data["approx_step_s"])


def test_cli_table_and_bad_steps(capsys):
    assert main(["bench", "tests.test_bench:tiny_cnn", "--input-shape", "16,3,8,8", "--steps", "1",
                 "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "train step" in out and "conv2" in out
    assert main(["bench", "tests.test_bench:tiny_cnn", "--input-shape", "16,3,8,8", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_bench_synchronises_an_accelerator_around_each_timed_step(monkeypatch):
    import importlib
    import types

    bench_module = importlib.import_module("fxapprox.bench")   # the package's ``bench`` name is the function

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    bench_module._device_synchronizer((on_cuda,))()
    assert waited == [torch.device("cuda", 0)]
    bench_module._device_synchronizer((torch.zeros(1),))()   # CPU: nothing to wait for
    assert len(waited) == 1
    calls = []
    monkeypatch.setattr(bench_module, "_device_synchronizer", lambda inputs: lambda: calls.append(1))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    fxapprox.bench(model, torch.randn(32, 64), budget=0.5, steps=2, warmup=1)
    assert len(calls) == 2 * 2 * (2 + 1)   # before and after each step, exact and approximated, every round


@pytest.mark.cuda
def test_bench_on_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    result = fxapprox.bench(model, torch.randn(64, 256, device="cuda"), budget=0.5, steps=3, warmup=1)
    assert result.exact_step_s > 0 and result.approx_step_s > 0


def test_gpu_suite_says_it_needs_a_gpu_and_exits_cleanly_without_one():
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the suite would run")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout
