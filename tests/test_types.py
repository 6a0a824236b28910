"""The library type-checks: mypy (pinned in the test extra, configured in pyproject.toml) over
``shardwise.composable``, ``shardwise.mesh`` and ``shardwise.checkpoint``, laid out as the one
``shardwise/`` tree they install as.

The tree and mypy's cache live in pytest's cache folder (``.pytest_cache/d/mypy``, kept between
runs, ignored by git), so a run after the first rechecks only the modules that changed and those
that depend on them (mypy's incremental mode compares each file's hash): about 27 s on a fresh
clone of a quiet 2-core machine, a few seconds after. With ``-p no:cacheprovider`` it runs
cold in a temporary folder."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _tree(base: pathlib.Path) -> pathlib.Path:
    """``base/shardwise/{composable,mesh,checkpoint}`` linked to this repository's folders."""
    tree = base / "shardwise"
    tree.mkdir(parents=True, exist_ok=True)
    for folder in ("composable", "mesh", "checkpoint"):
        link = tree / folder
        if link.is_symlink() and link.resolve() != (REPO / folder).resolve():
            link.unlink()  # the cache of another checkout
        if not link.is_symlink():
            link.symlink_to(REPO / folder, target_is_directory=True)
    return base


def test_mypy_passes_over_the_library(request, tmp_path):
    cache = getattr(request.config, "cache", None)
    base = _tree(cache.mkdir("mypy") if cache is not None else tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "shardwise", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(base / ".mypy_cache")],
        cwd=base, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"mypy found errors:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
