"""The layout shows the pipeline: no folder of fxapprox/ or passes/ holds more than 15 modules, no module imports
another that imports it back (directly or through others, counting imports inside functions), and
docs/architecture.md's layout names every folder there is."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"fxapprox": ROOT / "fxapprox", "fxapprox.passes": ROOT / "passes"}
MAX_MODULES = 15


def _modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the package (``passes/`` installs as ``fxapprox.passes``)."""
    found = {}
    for package, folder in ROOMS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _import_graph(modules: dict[str, Path]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t if t in modules else base for t in targets]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                # ``from module import name``: an import of the module
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def test_no_folder_holds_more_than_15_modules():
    crowded = {}
    for folder in ROOMS.values():
        for directory in [folder, *[d for d in folder.rglob("*") if d.is_dir() and d.name != "__pycache__"]]:
            count = len(list(directory.glob("*.py")))
            if count > MAX_MODULES:
                crowded[str(directory.relative_to(ROOT))] = count
    assert not crowded, f"folders over {MAX_MODULES} modules: {crowded}"


def test_no_import_cycles():
    graph = _import_graph(_modules())
    assert graph.number_of_edges() > 100  # the graph was read at all
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("from fxapprox.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from fxapprox import a\n")
    monkeypatch.setitem(ROOMS, "fxapprox", tmp_path)
    monkeypatch.delitem(ROOMS, "fxapprox.passes")
    graph = _import_graph(_modules())
    assert list(nx.simple_cycles(graph)) != []


def test_architecture_doc_names_every_folder():
    layout = (ROOT / "docs" / "architecture.md").read_text().split("## Layout", 1)[1]
    folders = [d for folder in ROOMS.values() for d in folder.rglob("*")
               if d.is_dir() and d.name != "__pycache__" and (d / "__init__.py").exists()]
    assert len(folders) >= 9
    missing = [d.name for d in folders if f"`{d.name}/`" not in layout]
    assert not missing, f"docs/architecture.md's layout does not name {missing}"
