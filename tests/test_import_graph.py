"""The library's import graph: no cycles (function-level and ``TYPE_CHECKING`` imports
included), and the wings of ``shardwise.composable`` import only what docs/architecture.md
allows.

The graph is read from the source with ``ast``, one node per module file (a package is its
``__init__``), every import statement resolved to the module it names.
"""

from __future__ import annotations

import ast
import pathlib

import shardwise.checkpoint
import shardwise.composable
import shardwise.mesh
from tests.test_checkpoint_modules import find_cycle  # one cycle finder for both graph tests

PACKAGES = {p.__name__: pathlib.Path(p.__file__).parent for p in (shardwise.composable, shardwise.mesh,
                                                                 shardwise.checkpoint)}


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


def import_graph() -> dict[str, set[str]]:
    known = set(MODULES)
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    full = f"{base}.{node.module}" if node.module else base
                else:
                    full = node.module or ""
                targets = [f"{full}.{a.name}" for a in node.names] + [full]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                r = _resolve(t, known)
                if r is not None and r != mod:
                    deps.add(r)
                    break
        graph[mod] = deps
    return graph


def test_graph_reader_sees_a_cycle():
    """The checker itself: a made-up two-module cycle is found, an acyclic graph is not."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "shardwise.composable._fsdp._state" in graph["shardwise.composable._fsdp._fully_shard"]


def test_no_import_cycles():
    graph = import_graph()
    # a package's __init__ re-exports its modules; an edge from a module back to its own
    # package's __init__ would be a cycle a reader sees: report it like any other
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


C = "shardwise.composable"
# what each wing of composable may import from the library (docs/architecture.md)
LEAVES = {f"{C}._compat", f"{C}._mesh_utils", f"{C}._chunks"}
ALLOWED = {
    f"{C}._fsdp": {"shardwise.checkpoint"},  # scatter_full: broadcast_from_rank0
    f"{C}._tp": set(),
    f"{C}._replicate": {f"{C}._fsdp"},
    f"{C}._wrap": {f"{C}._fsdp", f"{C}._replicate", "shardwise.mesh", "shardwise.checkpoint"},
    f"{C}._pipeline": {f"{C}._fsdp", f"{C}._tp", "shardwise.mesh", "shardwise.checkpoint"},
    f"{C}._plan": {f"{C}._fsdp", f"{C}._wrap", f"{C}._pipeline"},
    f"{C}._cp": set(),  # context parallelism: attention, layout and routing use only the shared leaves
    f"{C}._moe": {f"{C}._fsdp", f"{C}._tp", "shardwise.mesh"},
}


def _wing(mod: str) -> str | None:
    for w in ALLOWED:
        if mod == w or mod.startswith(w + "."):
            return w
    return None


def _top(mod: str) -> str:
    for w in ALLOWED:
        if mod == w or mod.startswith(w + "."):
            return w
    for pkg in ("shardwise.mesh", "shardwise.checkpoint"):
        if mod == pkg or mod.startswith(pkg + "."):
            return pkg
    return mod


def test_wings_import_only_what_they_may():
    bad = []
    for mod, deps in import_graph().items():
        wing = _wing(mod)
        if wing is None:
            continue
        for d in deps:
            top = _top(d)
            if top == wing or d in LEAVES or top in ALLOWED[wing]:
                continue
            bad.append(f"{mod} imports {d}")
    assert not bad, "wing rules broken (docs/architecture.md):\n" + "\n".join(sorted(bad))


def test_nothing_imports_the_planning_wing():
    users = sorted(m for m, deps in import_graph().items()
                   if any(_top(d) == f"{C}._plan" for d in deps) and _top(m) != f"{C}._plan" and m != C)
    assert not users, f"only shardwise.composable's __init__ may import _plan: {users}"
