"""The library type-checks: mypy (pinned in the test extra, configured in pyproject.toml) over
``shardwise.composable``, ``shardwise.mesh`` and ``shardwise.checkpoint``, laid out as the one
``shardwise/`` tree they install as."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_mypy_passes_over_the_library(tmp_path):
    tree = tmp_path / "shardwise"
    tree.mkdir()
    for folder in ("composable", "mesh", "checkpoint"):
        (tree / folder).symlink_to(REPO / folder, target_is_directory=True)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "shardwise", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(tmp_path / ".mypy_cache")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"mypy found errors:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
