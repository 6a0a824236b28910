"""The structure of ``checkpoint/``: every module imports, and no module imports itself back.

The intra-package import graph (subpackages included: ``_storage``, ``_geometry``, ``_format``)
is read from the source with ``ast`` (every import statement,
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


def _module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted name relative to the package: file}``: ``_reader``, ``_format._index``; a
    subpackage's ``__init__.py`` is the subpackage's own name (``_format``), the package's is
    ``__init__``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = sorted(n for n in _module_names(ROOT) if n != "__main__")  # __main__ runs the tool


def import_graph(root: pathlib.Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for every ``*.py`` under ``root``
    (subpackages included, their modules named ``_sub._mod``)."""
    files = _module_names(root)
    names = set(files)

    def node(target: str) -> str | None:  # the module a dotted target lives in
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in names:
                return ".".join(parts[:n])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py" and name != "__init__"
        here = name.split(".") if is_pkg else name.split(".")[:-1]  # the package this module is in
        deps: set[str] = set()
        for nd in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(nd, ast.ImportFrom):
                if nd.level >= 1:
                    base = here[: len(here) - (nd.level - 1)] if nd.level > 1 else list(here)
                    target = ".".join(base + ([nd.module] if nd.module else []))
                elif (nd.module or "").startswith(package + "."):
                    target = nd.module.removeprefix(package + ".")
                elif nd.module == package:
                    target = ""
                else:
                    continue
                for a in nd.names:
                    full = f"{target}.{a.name}" if target else a.name
                    found = full if full in names else node(target) if target else None
                    if found:
                        deps.add(found)
            elif isinstance(nd, ast.Import):
                for a in nd.names:
                    if a.name.startswith(package + "."):
                        found = node(a.name.removeprefix(package + "."))
                        if found:
                            deps.add(found)
        graph[name] = deps - {name}
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
    assert pathlib.Path(module.__file__).is_relative_to(ROOT), module.__file__


def test_checkpoint_modules_have_no_import_cycle():
    graph = import_graph(ROOT)
    assert "_reader" in graph and "_errors" in graph, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among checkpoint modules: {' -> '.join(cycle)}"


def test_leaf_modules_import_only_the_error_module():
    graph = import_graph(ROOT)
    assert graph["_errors"] == set(), graph["_errors"]
    assert graph["_checksums"] <= {"_errors"}, f"_checksums must be a leaf, imports {sorted(graph['_checksums'])}"


_LEAVES = {"_errors", "_checksums", "_json_strict", "_compat", "_trace", "_comm"}


def _outside(graph: dict[str, set[str]], room: str) -> dict[str, set[str]]:
    """What the modules of subpackage ``room`` import from outside it."""
    return {m: {d for d in deps if d != room and not d.startswith(room + ".")}
            for m, deps in graph.items() if m == room or m.startswith(room + ".")}


def test_the_rooms_import_only_the_layers_below_them():
    """``_storage`` (where files live) imports only the error type; ``_geometry`` (boxes, tiling,
    plans, owners: arithmetic) only the leaves; ``_format`` (index and safetensors io) the
    leaves, ``_storage`` and ``_geometry``; nothing below imports the load/save modules."""
    graph = import_graph(ROOT)
    assert {"_storage", "_geometry", "_format", "_format._index", "_geometry._tiling"} <= set(graph), sorted(graph)
    for room, allowed in [("_storage", {"_errors"}), ("_geometry", _LEAVES),
                          ("_format", _LEAVES | {"_storage"} | {m for m in graph if m.startswith("_geometry")})]:
        for module, deps in _outside(graph, room).items():
            assert deps <= allowed, f"{module} imports {sorted(deps - allowed)}, above its layer"


def test_only_the_communication_modules_import_the_communication_layer_for_the_error():
    """`CheckpointError` comes from ``_errors``; no module imports it from ``_comm``."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module in ("_comm", f"{PACKAGE}._comm")
                    and any(a.name == "CheckpointError" for a in node.names)):
                offenders.append(path.name)
    assert not offenders, f"import CheckpointError from ._errors, not ._comm: {offenders}"
