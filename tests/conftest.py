"""The fast tier: ``pytest -m "not slow"`` runs what is left when the tests in `SLOW` are
marked ``slow`` (docs/testing.md, "The fast tier"). The list is of node-id prefixes as pytest
prints them (a file, or ``file::test`` for every parametrization of one test), chosen from the
durations of a full run (``pytest --durations=0``) so that the rest takes under 4 minutes of
pytest time on a 2-core machine. An entry that names no file, or no test of its file, fails
the collection: the list cannot rot when a test is renamed or moved. The full run (README's
command) still runs everything."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SLOW: list[str] = [
]


def _defined(path: pathlib.Path) -> set[str]:
    """The test functions of a file, as ``name`` and ``Class::name``."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.update(f"{node.name}::{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef,
                                                                                    ast.AsyncFunctionDef)))
    return out


def _stale(entries: list[str]) -> list[str]:
    bad = []
    for entry in entries:
        file, _, test = entry.partition("::")
        path = ROOT / file
        if not path.is_file() or (test and test not in _defined(path)):
            bad.append(entry)
    return bad


def _matches(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stale = _stale(SLOW)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
    for item in items:
        if any(_matches(item.nodeid, entry) for entry in SLOW):
            item.add_marker(pytest.mark.slow)
