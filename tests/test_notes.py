"""Every ``[Note: name]`` reference resolves.

A note is *defined* where a line of a Python file starts with it (after indentation, a ``#`` or
a docstring's opening quotes): the note's text follows. Any other mention is a *reference*;
it must name a defined note, and when it says where (``[Note: name] in ``path.py```` or
``in path.py``) the note must be defined in a file whose path ends with that path (a leading
``shardwise/`` is the installed name of the repository's folders and is ignored).
"""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ["composable", "mesh", "checkpoint", "tests", "benchmarks", "examples", "docs", "README.md"]

NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# a heading alone on its line (in a docstring or a comment), or a comment that opens with it
DEFINITION = re.compile(r'^\s*(?:(?:#\s*|[rR]?"""\s*)?\[Note: ([^\]]+)\]\s*$|#\s*\[Note: ([^\]]+)\](?!`*\s+in\b))')
WHERE = re.compile(r"\[Note: ([^\]]+)\]`*\s+in\s+`*(?:shardwise/)?([\w./-]+\.py)\b")


def _files() -> list[pathlib.Path]:
    out: list[pathlib.Path] = []
    for name in SCANNED:
        p = REPO / name
        if p.is_file():
            out.append(p)
        else:
            out += sorted(q for q in p.rglob("*") if q.suffix in (".py", ".md") and ".venv" not in q.parts)
    out.remove(pathlib.Path(__file__).resolve())  # this file's examples are not the library's notes
    return out


def scan(files: dict[str, str]) -> tuple[dict[str, set[str]], list[tuple[str, int, str, str | None]]]:
    """``({note: files defining it}, [(file, line, note, where or None)] of references)``."""
    defined: dict[str, set[str]] = {}
    refs: list[tuple[str, int, str, str | None]] = []
    for rel, text in files.items():
        for i, line in enumerate(text.splitlines(), 1):
            d = DEFINITION.match(line) if rel.endswith(".py") else None
            if d:
                defined.setdefault(d.group(1) or d.group(2), set()).add(rel)
            wheres = {m.start(): m.group(2) for m in WHERE.finditer(line)}
            for m in NOTE.finditer(line):
                if d and m.start() == (d.start(1) if d.group(1) else d.start(2)) - len("[Note: "):
                    continue
                refs.append((rel, i, m.group(1), wheres.get(m.start())))
    return defined, refs


def problems(files: dict[str, str]) -> list[str]:
    defined, refs = scan(files)
    bad = [f"[Note: {n}] is defined in {len(fs)} files: {sorted(fs)}" for n, fs in sorted(defined.items())
           if len(fs) > 1]
    for rel, line, name, where in refs:
        if name not in defined:
            bad.append(f"{rel}:{line}: [Note: {name}] is defined nowhere")
        elif where and not any(f == where or f.endswith("/" + where) for f in defined[name]):
            bad.append(f"{rel}:{line}: [Note: {name}] is not in {where} but in {sorted(defined[name])}")
    return bad


def test_the_checker_sees_a_dangling_and_a_misplaced_reference():
    ok = {"a/_x.py": '"""[Note: one]\ntext"""\n', "b/_y.py": "# see [Note: one] in ``_x.py``\n",
          "b/_z.py": "    # [Note: three] opens a comment\n# [Note: three] in ``_z.py`` is a reference\n"}
    assert problems(ok) == []
    assert problems({**ok, "c.md": "[Note: two]\n"}) == ["c.md:1: [Note: two] is defined nowhere"]
    assert problems({**ok, "c.md": "[Note: one] in `a/_z.py`\n"}) == [
        "c.md:1: [Note: one] is not in a/_z.py but in ['a/_x.py']"]
    assert problems({**ok, "c/_x.py": "    # [Note: one]\n"}) == [
        "[Note: one] is defined in 2 files: ['a/_x.py', 'c/_x.py']"]


def test_every_note_reference_resolves():
    files = {str(p.relative_to(REPO)): p.read_text() for p in _files()}
    defined, refs = scan(files)
    assert len(defined) > 50 and len(refs) > 100, (len(defined), len(refs))  # the scan saw the notes
    bad = problems(files)
    assert not bad, "\n".join(bad)
