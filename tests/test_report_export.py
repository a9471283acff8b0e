import json
import shutil

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import fxapprox

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.conv = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(F.relu(self.conv(F.relu(self.stem(x)))).mean((2, 3)))


@pytest.fixture
def approx():
    return fxapprox.approximate(CNN(), 0.5, example_inputs=(torch.randn(2, 3, 8, 8),), config=FLOPS)


def test_report_text_rich_and_json(approx):
    text = str(approx.report)
    for expected in ("stem", "min_channels=16", "0.5 asked", "of exact training FLOPs planned (met)", "forward topk ×2"):
        assert expected in text
    assert "every layer\n" not in text   # the per-layer table (its title) is behind verbose
    verbose = approx.report.text(verbose=True)
    assert all(name in verbose for name in ("stem", "conv", "fc")) and "every layer" in verbose
    console = Console(record=True, width=200)
    approx.report.show(console, verbose=True)
    assert "conv" in console.export_text()
    data = json.loads(json.dumps(approx.report.to_dict()))
    assert data["budget"] == 0.5 and data["budget_met"] is True
    assert {layer["node"] for layer in data["layers"]} == {"stem", "conv", "fc"}
    conv = next(layer for layer in data["layers"] if layer["node"] == "conv")
    assert conv["approximate"] and 0 < conv["keep_ratio"] < 1 and 0 < conv["flops_share"] < 1
    assert "achieved=" in repr(approx.report)


def test_export_writes_readable_files(approx, tmp_path):
    paths = fxapprox.export(approx, tmp_path / "out")
    assert {"code", "json", "graphml", "dot", "report"} <= set(paths)
    code = paths["code"].read_text()
    compile(code, "graph.py", "exec")
    assert "def forward" in code and "self.conv" in code
    graph = json.loads(paths["json"].read_text())
    names = {node["name"] for node in graph["nodes"]}
    assert {"stem", "conv", "fc"} <= names and ["stem", "relu"] in graph["edges"]
    conv = next(node for node in graph["nodes"] if node["name"] == "conv")
    assert conv["fxapprox"]["plan"]["approximate"] and conv["fxapprox"]["flops_fwd"] > 0
    graphml = nx.read_graphml(paths["graphml"])
    assert graphml.has_edge("stem", "relu") and graphml.nodes["conv"]["op_kind"] == "conv2d"
    dot = paths["dot"].read_text()
    assert "digraph" in dot and '"stem" -> "relu"' in dot
    report = json.loads(paths["report"].read_text())
    assert report["total_planned_flops"] == approx.plan.total_planned_flops
    if shutil.which("dot"):
        assert paths["svg"].read_text().lstrip().startswith(("<?xml", "<svg"))


def test_export_requires_a_planned_approximated_module(tmp_path):
    with pytest.raises(TypeError, match="fxapprox.approximate"):
        fxapprox.export(CNN(), tmp_path)
    with pytest.raises(fxapprox.PlanNotReadyError):
        fxapprox.export(fxapprox.approximate(CNN(), 0.5, config=FLOPS), tmp_path)


class Deep(nn.Module):
    """Twelve narrow layers (reduce over 8 < min_channels) and two wide ones."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(256, 256)
        self.narrow = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        x = self.head(F.relu(self.wide(x)))
        for layer in self.narrow:
            x = F.relu(layer(x))
        return x


def test_report_groups_identical_reasons_and_fits_120_columns():
    approx = fxapprox.approximate(Deep(), 0.9, example_inputs=(torch.randn(64, 256),), config=FLOPS)
    text = str(approx.report)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert text.count("reduces over 8 channels < min_channels=16") == 1
    assert "12 layer(s): reduces over 8 channels < min_channels=16 (narrow.0, narrow.1, narrow.2 and 9 more)" in text
    verbose = approx.report.text(verbose=True)
    assert max(len(line) for line in verbose.splitlines()) <= 120
    assert verbose.count("reduces over 8 channels") >= 12   # every layer's own row
