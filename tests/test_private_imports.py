"""Tests reach the library through its public names wherever one exists: a test that imports
``Z`` from a private module although ``shardwise.<package>`` exports ``Z`` fails here, and every
private module the tests still import is listed, with why, in docs/testing.md ("Private
imports in tests")."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "testing.md"
PUBLIC = ("shardwise.composable", "shardwise.mesh", "shardwise.checkpoint")


def _private_imports() -> dict[str, set[tuple[str, str]]]:
    """``{private module: {(test file, name), ...}}`` over every test file."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module in PUBLIC:  # from shardwise.composable import _x (a private module)
                    mods += [(f"{node.module}.{a.name}", []) for a in node.names if a.name.startswith("_")]
                else:
                    mods.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                mods += [(a.name, []) for a in node.names]
            for mod, names in mods:
                if mod.startswith(PUBLIC) and any(part.startswith("_") for part in mod.split(".")[2:]):
                    for n in names or ["*"]:
                        out.setdefault(mod, set()).add((path.relative_to(TESTS.parent).as_posix(), n))
    return out


def test_public_names_are_imported_from_the_public_package():
    bad = []
    for mod, uses in _private_imports().items():
        pkg = next(p for p in PUBLIC if mod.startswith(p))
        public = set(getattr(importlib.import_module(pkg), "__all__", ()))
        bad += [f"{f}: from {mod} import {n} (use: from {pkg} import {n})" for f, n in uses if n in public]
    assert not bad, "\n".join(sorted(bad))


def test_every_private_module_the_tests_import_is_listed_in_the_docs():
    text = DOC.read_text()
    section = text.split("## Private imports in tests", 1)
    assert len(section) == 2, "docs/testing.md has no 'Private imports in tests' section"
    listed = set(re.findall(r"`(shardwise\.[\w.]+)`", section[1].split("\n## ", 1)[0]))
    missing = sorted(set(_private_imports()) - listed)
    assert not missing, f"private modules imported by tests but not listed in docs/testing.md: {missing}"
