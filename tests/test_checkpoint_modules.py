"""The structure of ``checkpoint/``: every module imports, and no module imports itself back.

The intra-package import graph is read from the source with ``ast`` (every import statement,
including those under ``if TYPE_CHECKING:`` and inside functions: a cycle there still ties the
modules together for a reader and for a type checker). It must have no cycle, and the leaf
modules (the exception type, the CRC arithmetic) must import nothing of the package but
``_errors``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import shardwise.checkpoint

PACKAGE = "shardwise.checkpoint"
ROOT = pathlib.Path(shardwise.checkpoint.__file__).parent
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__main__")  # __main__ runs the tool


def import_graph(root: pathlib.Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for every ``*.py`` in ``root``."""
    names = {p.stem for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    base = node.module or ""
                elif node.level == 0 and (node.module or "").startswith(package + "."):
                    base = node.module.removeprefix(package + ".")
                elif node.level == 0 and node.module == package:
                    base = ""
                else:
                    continue
                if base:
                    deps.add(base.split(".")[0])
                else:  # from . import _x, _y
                    deps.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(package + "."):
                        deps.add(a.name.removeprefix(package + ".").split(".")[0])
        graph[path.stem] = (deps & names) - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_relative_absolute_and_type_checking_imports(tmp_path):
    (tmp_path / "_a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import X\n")
    (tmp_path / "_b.py").write_text("from . import _c\n")
    (tmp_path / "_c.py").write_text(f"def f():\n    import {PACKAGE}._a\n")
    graph = import_graph(tmp_path)
    assert graph == {"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}, graph
    assert find_cycle(graph) == ["_a", "_b", "_c", "_a"]


@pytest.mark.parametrize("name", MODULES)
def test_every_checkpoint_module_imports(name):
    module = importlib.import_module(PACKAGE if name == "__init__" else f"{PACKAGE}.{name}")
    assert pathlib.Path(module.__file__).parent == ROOT, module.__file__


def test_checkpoint_modules_have_no_import_cycle():
    graph = import_graph(ROOT)
    assert "_reader" in graph and "_errors" in graph, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among checkpoint modules: {' -> '.join(cycle)}"


def test_leaf_modules_import_only_the_error_module():
    graph = import_graph(ROOT)
    assert graph["_errors"] == set(), graph["_errors"]
    assert graph["_checksums"] <= {"_errors"}, f"_checksums must be a leaf, imports {sorted(graph['_checksums'])}"


def test_only_the_communication_modules_import_the_communication_layer_for_the_error():
    """`CheckpointError` comes from ``_errors``; no module imports it from ``_comm``."""
    offenders = []
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module in ("_comm", f"{PACKAGE}._comm")
                    and any(a.name == "CheckpointError" for a in node.names)):
                offenders.append(path.name)
    assert not offenders, f"import CheckpointError from ._errors, not ._comm: {offenders}"
