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
    for expected in ("stem", "conv", "fc", "min_channels=16", "budget asked 0.5", "achieved", "topk"):
        assert expected in text
    console = Console(record=True, width=200)
    approx.report.show(console)
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
