"""The structure of ``checkpoint/``: every module imports, and no module imports itself back.

The intra-package import graph (every room, a subpackage, included) is read from the source with ``ast`` (every import statement,
including those under ``if TYPE_CHECKING:`` and inside functions: a cycle there still ties the
modules together for a reader and for a type checker). It must have no cycle; the leaf
modules (the exception type, the CRC arithmetic) must import nothing of the package but
``_errors``; and the rooms must keep their order (``ROOMS`` in ``checkpoint/__init__.py``, lowest
first): a room imports only rooms below it, and only through their ``__init__``.
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
    assert "_load._reader" in graph and "_base._errors" in graph, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among checkpoint modules: {' -> '.join(cycle)}"


def test_leaf_modules_import_only_the_error_module():
    graph = import_graph(ROOT)
    assert graph["_base._errors"] == set(), graph["_base._errors"]
    assert graph["_base._checksums"] <= {"_base._errors"}, \
        f"_checksums must be a leaf, imports {sorted(graph['_base._checksums'])}"


TOP = {"__init__", "__main__", "_cli"}  # the only modules outside a room


def room_problems(graph: dict[str, set[str]], rooms: tuple[str, ...]) -> list[str]:
    """What breaks the room rules (``shardwise.checkpoint.ROOMS``, lowest first): every module
    is a top module or in a listed room; a room imports only rooms listed before it, and another
    room only through its ``__init__`` (the top modules too); nothing imports a top module but
    the top."""
    problems = []

    def room(m: str) -> str | None:
        return None if m in TOP else m.split(".")[0]

    for m in sorted(graph):
        if room(m) is not None and room(m) not in rooms:
            problems.append(f"{m} is in no room of ROOMS {rooms}")
    for m, deps in sorted(graph.items()):
        rm = room(m)
        for d in sorted(deps):
            rd = room(d)
            if rd == rm or (rm is None and d in TOP):
                continue
            if rd is None:
                problems.append(f"{m} imports the top module {d}")
            elif rd not in rooms:
                problems.append(f"{m} imports {d}, in no room of ROOMS")
            elif d != rd:
                problems.append(f"{m} imports {d}: another room only through its __init__ ({rd})")
            elif rm is not None and rm in rooms and rooms.index(rd) >= rooms.index(rm):
                problems.append(f"{m} imports {rd}, a room not below its room {rm} in ROOMS")
    return problems


def room_levels(graph: dict[str, set[str]]) -> int:
    """The longest chain of rooms importing rooms (1: a room that imports no other)."""
    edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m not in TOP:
            edges.setdefault(m.split(".")[0], set()).update(d.split(".")[0] for d in deps if d not in TOP)
    memo: dict[str, int] = {}

    def level(r: str) -> int:
        if r not in memo:
            memo[r] = 0  # a cycle (reported by the cycle test) counts once
            memo[r] = 1 + max((level(d) for d in edges.get(r, ()) if d != r), default=0)
        return memo[r]

    return max(level(r) for r in edges)


def test_room_rules_catch_an_unknown_room_an_upward_import_and_a_reach_past_init():
    rooms = ("_a", "_b")
    assert room_problems({"_a._x": {"_a._y"}, "_a._y": set(), "_b._z": {"_a"}, "_cli": {"_b"}}, rooms) == []
    assert room_problems({"_a._x": {"_b"}, "_b": set()}, rooms) == ["_a._x imports _b, a room not below its room _a "
                                                                    "in ROOMS"]
    assert room_problems({"_b._z": {"_a._x"}, "_a._x": set()}, rooms) == [
        "_b._z imports _a._x: another room only through its __init__ (_a)"]
    assert room_problems({"_c._z": set()}, rooms) == ["_c._z is in no room of ROOMS ('_a', '_b')"]
    assert room_problems({"_a._x": {"_cli"}, "_cli": set()}, rooms) == ["_a._x imports the top module _cli"]


def test_the_rooms_import_only_rooms_below_them_through_their_init():
    graph = import_graph(ROOT)
    rooms = shardwise.checkpoint.ROOMS
    assert {m for m in graph if "." not in m and m not in TOP} == set(rooms), "ROOMS must list every room"
    problems = room_problems(graph, rooms)
    assert not problems, "room rules broken (ROOMS in checkpoint/__init__.py):\n" + "\n".join(problems)


def test_the_top_holds_three_files_and_the_rooms_at_most_ten_levels():
    assert {p.name for p in ROOT.glob("*.py")} == {"__init__.py", "__main__.py", "_cli.py"}
    assert room_levels(import_graph(ROOT)) <= 10


def test_the_lowest_rooms_import_only_the_base():
    """``_base`` imports nothing of the package; ``_storage`` (where files live) and
    ``_geometry`` (boxes, tiling, plans, owners: arithmetic) only ``_base``."""
    graph = import_graph(ROOT)
    for room, allowed in [("_base", set()), ("_storage", {"_base"}), ("_geometry", {"_base"})]:
        for module, deps in graph.items():
            if module.split(".")[0] == room:
                outside = {d for d in deps if d.split(".")[0] != room}
                assert outside <= allowed, f"{module} imports {sorted(outside - allowed)}, above its layer"


def test_only_the_communication_modules_import_the_communication_layer_for_the_error():
    """`CheckpointError` comes from ``_errors``; no module imports it from ``_comm``."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_comm")
                    and any(a.name == "CheckpointError" for a in node.names)):
                offenders.append(path.name)
    assert not offenders, f"import CheckpointError from ._errors, not ._comm: {offenders}"
