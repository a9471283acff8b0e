"""``fxapprox.export``: write the transformed graph to a directory.

Files: ``graph.py`` (readable Python of the transformed graph), ``graph.json``
(nodes, edges, each node's analysis and plan), ``graph.graphml`` and
``graph.dot`` (written by networkx), ``report.json``, ``report.txt`` (the report
with every layer's plan and why), and ``graph.svg`` when graphviz's ``dot`` is on
``PATH``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import networkx as nx
import torch

from fxapprox.api import ApproxGraphModule
from fxapprox.passes.analysis.graph_view import to_networkx


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (torch.dtype, torch.Size)):
        return str(value)
    return repr(value)


def _flat_attributes(attributes: dict) -> dict:
    """GraphML and DOT take scalar attributes only: nested values become JSON strings."""
    flat = {}
    for key, value in attributes.items():
        if key == "fxapprox":
            for meta_key, meta_value in value.items():
                meta_value = _jsonable(meta_value)
                flat[meta_key] = meta_value if isinstance(meta_value, (str, int, float, bool)) \
                    else json.dumps(meta_value)
        else:
            flat[key] = value
    return {k: v for k, v in flat.items() if v is not None}


def _dot_quote(graph: nx.DiGraph) -> nx.DiGraph:
    quoted = nx.DiGraph()
    for node, attributes in graph.nodes(data=True):
        plan = attributes.get("fxapprox", {}).get("plan") or {}
        label = f"{node}\\n{attributes['target']}"
        if plan.get("approximate"):
            label += f"\\n{plan['method']} keep {plan['keep_ratio']:.2f}"
        flat = {k: json.dumps(str(v)) for k, v in _flat_attributes(attributes).items()}
        flat["label"] = json.dumps(label)
        flat.update({"style": '"filled"', "fillcolor": '"palegreen"'} if plan.get("approximate") else {})
        quoted.add_node(json.dumps(node), **flat)
    for source, target in graph.edges():
        quoted.add_edge(json.dumps(source), json.dumps(target))
    return quoted


def export(approx: ApproxGraphModule, directory: str | Path) -> dict[str, Path]:
    """Write the transformed graph of ``approx`` into ``directory``; returns ``{kind: path}``.

    Example::

        >>> paths = fxapprox.export(approx, "out/resnet18")
        >>> sorted(paths)
        ['code', 'dot', 'graphml', 'json', 'report', 'report_text']
    """
    if not isinstance(approx, ApproxGraphModule):
        raise TypeError(f"export takes a module returned by fxapprox.approximate, got {type(approx).__name__}")
    report = approx.report  # raises the explanatory error when not planned yet
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    graph = to_networkx(approx)
    paths = {
        "code": out / "graph.py",
        "json": out / "graph.json",
        "graphml": out / "graph.graphml",
        "dot": out / "graph.dot",
        "report": out / "report.json",
        "report_text": out / "report.txt",
    }
    header = (f"# Transformed graph of {report.model_name}, written by fxapprox.export.\n"
              f"# {report.plan.note}\n")
    paths["code"].write_text(header + approx.code)
    document = {
        "model": report.model_name,
        "nodes": [{"name": name, **_jsonable(attributes)} for name, attributes in graph.nodes(data=True)],
        "edges": [[source, target] for source, target in graph.edges()],
        "plan": report.plan.to_dict(),
    }
    paths["json"].write_text(json.dumps(document, indent=1))
    flat = nx.DiGraph()
    flat.add_nodes_from((name, _flat_attributes(attributes)) for name, attributes in graph.nodes(data=True))
    flat.add_edges_from(graph.edges())
    nx.write_graphml(flat, paths["graphml"])
    nx.nx_pydot.write_dot(_dot_quote(graph), paths["dot"])
    paths["report"].write_text(json.dumps(report.to_dict(), indent=1))
    paths["report_text"].write_text(report.text(verbose=True))   # the summary and every layer's plan and why
    dot = shutil.which("dot")
    if dot is not None:
        svg = out / "graph.svg"
        result = subprocess.run([dot, "-Tsvg", str(paths["dot"]), "-o", str(svg)], capture_output=True, text=True,
                                timeout=120)
        if result.returncode == 0:
            paths["svg"] = svg
        else:
            raise RuntimeError(f"graphviz dot failed on {paths['dot']}: {result.stderr.strip()}")
    return paths
