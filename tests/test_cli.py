import json
import subprocess
import sys

import pytest

from fxapprox.cli import main

CLI = [sys.executable, "-m", "fxapprox.cli"]


def _run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_report_json():
    result = _run("report", "torchvision:resnet18", "--budget", "0.5", "--input-shape", "2,3,32,32", "--json",
                  "--policy", "flops")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["budget_met"] and data["model"] == "ResNet" and data["config"]["policy"] == "flops"


def test_report_measured_policy_json():
    result = _run("report", "tests.test_cli:tiny_model", "--budget", "0.7", "--input-shape", "64,32", "--json",
                  "--min-speedup", "none", "--max-grad-error", "none", "--min-gain", "none")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["config"]["policy"] == "measured" and data["config"]["min_speedup"] is None
    assert data["predicted_error"] is not None and data["budget_met"]
    assert all(layer["candidates"] for layer in data["layers"] if layer["op_kind"] == "linear")


def test_report_summary_and_verbose_table():
    result = _run("report", "torchvision:resnet18", "--input-shape", "2,3,32,32", "--budget", "0.5", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "layer4.1.conv2" in result.stdout and "0.5 asked" in result.stdout and "every layer" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 120
    default = _run("report", "torchvision:resnet18", "--input-shape", "2,3,32,32")
    assert default.returncode == 0, default.stderr
    assert "budget     auto" in default.stdout and "every layer\n" not in default.stdout


def test_report_with_memory_budget():
    result = _run("report", "torchvision:resnet18", "--budget", "1", "--memory-budget", "0.25",
                  "--input-shape", "8,3,64,64", "--json")
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    assert memory["budget_met"] and memory["total_planned_bytes"] <= 0.25 * memory["total_exact_bytes"]


def test_export(tmp_path):
    result = _run("export", "tests.test_cli:tiny_model", "-o", str(tmp_path), "--input-shape", "4,32")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "graph.json").exists() and "graph.py" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("report", "torchvision:not_a_model"), "unknown torchvision model"),
    (("report", "resnet18"), "expected torchvision:NAME"),
    (("report", "no_such_pkg.mod:f"), "cannot import"),
    (("report", "torchvision:resnet18", "--budget", "2"), "budget must be in (0, 1]"),
    (("report", "torchvision:resnet18", "--budget", "half"), "--budget 'half'"),
    (("report", "torchvision:resnet18", "--input-shape", "1,x"), "--input-shape '1,x'"),
    (("report", "torchvision:resnet18", "--input-shape", "2,5,32,32"), "failed on the example inputs"),
    (("report", "torchvision:resnet18", "--method", "nope"), "method must be one of"),
    (("report", "torchvision:resnet18", "--memory-budget", "x"), "--memory-budget 'x'"),
    (("report", "torchvision:resnet18", "--memory-budget", "0"), "memory_budget must be in (0, 1]"),
    (("report", "torchvision:resnet18", "--policy", "greedy"), "policy must be one of"),
    (("report", "torchvision:resnet18", "--max-grad-error", "x"), "--max-grad-error 'x'"),
    (("report", "torchvision:resnet18", "--min-speedup", "-1"), "min_speedup must be"),
])
def test_errors_are_one_line(args, message, capsys):
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_error_in_a_subprocess_has_no_traceback():
    result = _run("report", "torchvision:resnet18", "--budget", "0")
    assert result.returncode == 2 and result.stderr.startswith("fxapprox: error: budget")
    assert "Traceback" not in result.stderr


def tiny_model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
