"""What ``composable/_tp/_compat.py`` relies on in the installed torch (one test per helper)."""

from __future__ import annotations

from shardwise.composable._tp._compat import current_mesh
from tests._dist import run_ranks
from tests._models import make_mesh


def _nested_meshes(rank, world):
    outer, inner = make_mesh((world,)), make_mesh((world,))
    seen = [current_mesh()]
    with outer:
        seen.append(current_mesh())
        with inner:
            seen.append(current_mesh())
        seen.append(current_mesh())
    seen.append(current_mesh())
    return [None if m is None else ("outer" if m is outer else "inner" if m is inner else "other") for m in seen]


def test_current_mesh_follows_with_blocks_innermost_first():
    for r in run_ranks(_nested_meshes, 2):
        assert r == [None, "outer", "inner", "outer", None], r
