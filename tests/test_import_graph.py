"""The library's import graph and its layers (docs/architecture.md).

The graph is read from the source with ``ast``: one node per module file (a package is its
``__init__``); every import statement counts, function-level and ``TYPE_CHECKING`` ones
included, and every name of ``from x import a, b`` (a name that is a submodule is an edge to
that submodule, any other name an edge to ``x``). The rules:

1. No cycle.
2. The packages are layered: ``shardwise.mesh`` imports no other shardwise package,
   ``shardwise.checkpoint`` only ``shardwise.mesh``, ``shardwise.composable`` both.
3. Every module has a declared place. In ``shardwise.composable`` that is a wing (a subpackage,
   ``WINGS``) or a top module (``TOP``); a package or wing with subpackages declares them, lowest
   first, in its ``ROOMS`` constant (a room is a subpackage or a single module). A subpackage,
   wing or top module declared nowhere fails the test: a new one must be placed here, not
   slip past.
4. A wing or top module imports only what ``WINGS`` / ``TOP`` allow it, and another wing or
   package only through its ``__init__``.
5. Inside a package with ``ROOMS``, a room imports only rooms listed below it, and those only
   through their ``__init__``; the modules outside every room (``__init__``, a command line)
   sit above all rooms and also enter them only through their ``__init__``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import shardwise.checkpoint
import shardwise.composable
import shardwise.mesh
from tests.test_checkpoint_modules import find_cycle  # one cycle finder for both graph tests

PACKAGES = {p.__name__: pathlib.Path(p.__file__).parent for p in (shardwise.mesh, shardwise.checkpoint,
                                                                 shardwise.composable)}
# rule 2: what each package may import of the others
PACKAGE_ALLOWED = {
    "shardwise.mesh": set(),
    "shardwise.checkpoint": {"shardwise.mesh"},
    "shardwise.composable": {"shardwise.mesh", "shardwise.checkpoint"},
}

C = "shardwise.composable"
# rules 3-4 in shardwise.composable: each wing and what it may import besides the leaves
LEAVES = {f"{C}._compat", f"{C}._mesh_utils", f"{C}._chunks"}
WINGS = {
    f"{C}._fsdp": {"shardwise.mesh"},
    f"{C}._tp": set(),
    f"{C}._cp": set(),
    f"{C}._replicate": {f"{C}._fsdp"},
    f"{C}._wrap": {f"{C}._fsdp", f"{C}._replicate", "shardwise.mesh", "shardwise.checkpoint"},
    f"{C}._moe": {f"{C}._fsdp", f"{C}._tp", "shardwise.mesh"},
    f"{C}._pipeline": {f"{C}._fsdp", f"{C}._tp", "shardwise.mesh", "shardwise.checkpoint"},
    f"{C}._plan": {f"{C}._fsdp", f"{C}._wrap", f"{C}._pipeline", "shardwise.mesh"},
    f"{C}._optim": {"shardwise.mesh", "shardwise.checkpoint"},
}
EVERYTHING = set(WINGS) | {"shardwise.mesh", "shardwise.checkpoint"}
TOP = {
    **{leaf: set() for leaf in LEAVES},
    f"{C}._clip_grad": set(),
    # the public faces: each re-exports its wing(s)
    f"{C}.fsdp": {f"{C}._fsdp", f"{C}._replicate", f"{C}._wrap", f"{C}._clip_grad"},
    f"{C}.tp": {f"{C}._tp"},
    f"{C}.pipeline": {f"{C}._pipeline"},
    f"{C}.cp": {f"{C}._cp"},
    f"{C}.moe": {f"{C}._moe"},
    f"{C}.optim": {f"{C}._optim"},
    C: EVERYTHING | {f"{C}._clip_grad", f"{C}.fsdp", f"{C}.tp", f"{C}.pipeline", f"{C}.cp", f"{C}.moe", f"{C}.optim"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, source: str, is_pkg: bool, known: set[str]) -> set[str]:
    """The library modules ``mod`` imports: every statement, every name."""
    here = mod if is_pkg else mod.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                full = f"{base}.{node.module}" if node.module else base
            else:
                full = node.module or ""
            # each name: a submodule (an edge to it) or an attribute of ``full`` (an edge to it)
            targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in known else full for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            r = _resolve(t, known)
            if r is not None and r != mod:
                deps.add(r)
    return deps


def import_graph(modules: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    modules = MODULES if modules is None else modules
    known = set(modules)
    return {mod: imports_of(mod, path.read_text(), path.name == "__init__.py", known)
            for mod, path in modules.items()}


def _inside(mod: str, container: str) -> bool:
    return mod == container or mod.startswith(container + ".")


def _package(mod: str) -> str:
    return next(p for p in PACKAGES if _inside(mod, p))


def _subpackages() -> set[str]:
    return {m for m, path in MODULES.items() if path.name == "__init__.py"}


def _roomed() -> dict[str, tuple[str, ...]]:
    """``{container: its rooms as full names, lowest first}`` for every package or wing that
    declares ``ROOMS``."""
    out = {}
    for mod in sorted(_subpackages()):
        rooms = getattr(importlib.import_module(mod), "ROOMS", None)
        if rooms is not None:
            out[mod] = tuple(f"{mod}.{r}" for r in rooms)
    return out


ROOMED = _roomed()


def place(mod: str) -> str | None:
    """Where ``mod`` is declared (rule 3): its composable wing or top module, or None."""
    if not _inside(mod, C):
        return _package(mod)
    if mod in TOP:
        return mod
    return next((w for w in WINGS if _inside(mod, w)), None)


def room_of(mod: str) -> tuple[str, int] | None:
    """``(container, index of mod's room)``, index -1 for a module outside every room of a
    roomed container, or None when mod's container declares no rooms."""
    for container, rooms in ROOMED.items():
        if _inside(mod, container):
            for i, room in enumerate(rooms):
                if _inside(mod, room):
                    return container, i
            return container, -1
    return None


def layer_problems(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    # rule 3: every subpackage is a wing, a package, or a declared room; every module placed
    declared = set(PACKAGES) | set(WINGS) | set(ROOMED) | {r for rooms in ROOMED.values() for r in rooms}
    for sub in sorted(_subpackages()):
        if sub not in declared and not any(_inside(sub, r) for rooms in ROOMED.values() for r in rooms):
            bad.append(f"{sub} is a subpackage no ROOMS constant or WINGS entry declares")
    for rooms in ROOMED.values():
        for r in rooms:
            if r not in MODULES:
                bad.append(f"ROOMS names {r}, which does not exist")
    for mod in sorted(graph):
        if place(mod) is None:
            bad.append(f"{mod} is in no declared wing or top module of {C}")
    for mod, deps in sorted(graph.items()):
        src = place(mod)
        for d in sorted(deps):
            dst = place(d)
            if src is None or dst is None:
                continue
            # rule 2
            if _package(mod) != _package(d) and _package(d) not in PACKAGE_ALLOWED[_package(mod)]:
                bad.append(f"{mod} imports {d}: {_package(mod)} may not import {_package(d)}")
                continue
            # rule 4: across wings / packages / top modules
            if src != dst:
                allowed = TOP[src] if src in TOP else WINGS.get(src, PACKAGE_ALLOWED.get(src, set()))
                if dst not in allowed and dst not in LEAVES:
                    bad.append(f"{mod} imports {d}: {src} may not import {dst}")
                elif d != dst:
                    bad.append(f"{mod} imports {d}: enter {dst} through its __init__")
                continue
            # rule 5: inside one roomed container
            a, b = room_of(mod), room_of(d)
            if a is None or b is None or a[0] != b[0]:
                continue
            container, rooms = a[0], ROOMED[a[0]]
            if a[1] == b[1] and a[1] >= 0:
                continue  # siblings in one room
            if b[1] == -1:
                if a[1] == -1:
                    continue  # the top modules of one container: its __init__, a command line
                bad.append(f"{mod} imports {d}, which is above every room of {container}")
            elif a[1] != -1 and b[1] > a[1]:
                bad.append(f"{mod} imports {d}: room {rooms[a[1]]} is below room {rooms[b[1]]}")
            elif d != rooms[b[1]]:
                bad.append(f"{mod} imports {d}: enter room {rooms[b[1]]} through its __init__")
    return bad


# --- the reader itself ---------------------------------------------------------------------------

def test_the_reader_sees_every_name_and_every_statement():
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    src = ("from typing import TYPE_CHECKING\nfrom . import a, b\nif TYPE_CHECKING:\n    from .c import X\n"
           "def f():\n    import p.d\n")
    assert imports_of("p.m", src, False, known) == {"p.a", "p.b", "p.c", "p.d"}
    # the second name of `from x import a, b` counts (the hole this test once had)
    assert imports_of("p.m", "from p import X, d\n", False, known) == {"p", "p.d"}
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert f"{C}._fsdp" in graph[f"{C}._wrap._policy"]


def test_a_planted_violation_is_seen():
    graph = {m: set(d) for m, d in import_graph().items()}
    # each planted edge adds a problem: an upward import between packages, a wing the importer may
    # not use, a wing entered past its __init__, a room importing a room above it, an unplaced module
    rooms = next(iter(ROOMED.values()), None)
    planted = {
        "shardwise.mesh._init": {"shardwise.checkpoint"},
        f"{C}._tp._styles": {f"{C}._fsdp"},
        f"{C}._wrap._policy": {f"{C}._fsdp._state"} if f"{C}._fsdp._state" in MODULES else {f"{C}._fsdp._layout"},
    }
    for mod, extra in planted.items():
        g = {m: set(d) for m, d in graph.items()}
        g[mod] |= extra
        assert len(layer_problems(g)) > len(layer_problems(graph)), (mod, extra)
    if rooms and len(rooms) >= 2:
        low, high = rooms[0], rooms[-1]
        low_mod = next(m for m in graph if _inside(m, low))
        g = {m: set(d) for m, d in graph.items()}
        g[low_mod] |= {high}
        assert len(layer_problems(g)) > len(layer_problems(graph)), (low_mod, high)
    g = {m: set(d) for m, d in graph.items()}
    g[f"{C}._unplaced"] = set()
    assert any("_unplaced" in p for p in layer_problems(g))


# --- the verdicts --------------------------------------------------------------------------------

def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_only_what_its_layer_may():
    bad = layer_problems(import_graph())
    assert not bad, "layer rules broken (docs/architecture.md):\n" + "\n".join(bad)


def test_the_big_packages_declare_their_rooms():
    """checkpoint and the pipeline wing are built of rooms; each room is listed once."""
    assert {"shardwise.checkpoint", f"{C}._pipeline"} <= set(ROOMED), sorted(ROOMED)
    for container, rooms in ROOMED.items():
        assert rooms and len(set(rooms)) == len(rooms), (container, rooms)


def test_every_declared_top_module_exists():
    assert not [m for m in TOP if m not in MODULES], [m for m in TOP if m not in MODULES]


def test_nothing_imports_the_planning_wing():
    users = sorted(m for m, deps in import_graph().items()
                   if any(_inside(d, f"{C}._plan") for d in deps) and not _inside(m, f"{C}._plan") and m != C)
    assert not users, f"only shardwise.composable's __init__ may import _plan: {users}"
