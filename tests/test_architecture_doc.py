"""docs/architecture.md names every module of the library by its path in the repository
(``composable/_fsdp/_state.py``; a package by its folder, ``checkpoint/_save/``), and every path
it names exists: the map cannot fall behind the tree, in either direction."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
FOLDERS = ("composable", "mesh", "checkpoint")


def library_paths() -> set[str]:
    out = set()
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO)
            out.add(f"{rel.parent}/" if path.name == "__init__.py" else str(rel))
    return out


def named_paths(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w/])((?:%s)/(?:[\w/]*?(?:\.py|/))?)(?![\w/])" % "|".join(FOLDERS), text))


def test_the_reader_finds_paths():
    text = "`composable/_fsdp/_state.py` and checkpoint/_save/ and `mesh/` but not xcomposable/_a.py"
    assert named_paths(text) == {"composable/_fsdp/_state.py", "checkpoint/_save/", "mesh/"}


def test_architecture_names_every_module():
    text = DOC.read_text()
    missing = sorted(library_paths() - named_paths(text))
    assert not missing, f"docs/architecture.md does not name {len(missing)} modules: {missing}"


def test_architecture_names_no_module_that_is_gone():
    gone = sorted(p for p in named_paths(DOC.read_text()) if p not in library_paths())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"
