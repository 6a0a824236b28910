"""The ``cp`` mesh axis: `ParallelDims` arithmetic, `init_mesh(cp=...)`'s layout (torchtitan's
``pp, dp_replicate, dp_shard, cp, tp``), the ``dp_shard_cp`` shard axis that
`data_parallel_mesh` returns, `cp_mesh`, and the one torch private API behind the flattening
(``mesh/_compat.py``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from shardwise.mesh import ParallelDims, cp_mesh, data_parallel_mesh, init_mesh, mesh_axes
from shardwise.mesh._compat import flatten_axes
from tests._dist import run_ranks


@settings(max_examples=80, deadline=None)
@given(rep=st.integers(1, 3), shard=st.integers(1, 3), cp=st.integers(1, 4), tp=st.integers(1, 3),
       pp=st.integers(1, 2), infer=st.booleans())
def test_cp_sizes_multiply_and_sit_before_tp(rep, shard, cp, tp, pp, infer):
    world = rep * shard * cp * tp * pp
    dims = ParallelDims(dp_replicate=rep, dp_shard=-1 if infer else shard, cp=cp, tp=tp, pp=pp, world_size=world)
    assert dims.dp_shard == shard and dims.stage_size == world // pp
    inner = ("dp_replicate", "dp_shard", "cp", "tp") if cp > 1 else ("dp_replicate", "dp_shard", "tp")
    assert dims.axis_names == (("pp",) if pp > 1 else ()) + inner
    sizes = dict(zip(dims.axis_names, dims.mesh_shape))
    assert sizes.get("cp", 1) == cp and sizes["tp"] == tp and sizes["dp_shard"] == shard


def test_bad_cp_sizes_are_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"tp\(1\) \* cp\(3\) = 3"):
        ParallelDims(cp=3, world_size=8)
    with pytest.raises(ValueError, match=r"dp_shard\(2\) \* tp\(1\) \* cp\(2\) = 4 != world_size\(8\)"):
        ParallelDims(dp_shard=2, cp=2, world_size=8)
    with pytest.raises(ValueError, match="cp=-1 is invalid"):
        ParallelDims(cp=-1, world_size=4)
    with pytest.raises(TypeError, match="cp must be an int"):
        ParallelDims(cp=True, world_size=4)


def _meshes(rank, world_size):
    out = {}
    for name, kw in {"shard-cp": dict(cp=2), "cp-tp": dict(cp=2, tp=2), "hsdp-cp": dict(dp_replicate=2, cp=2),
                     "no-cp": dict()}.items():
        mesh = init_mesh(device_type="cpu", **kw)
        dp = data_parallel_mesh(mesh)
        cpm = cp_mesh(mesh)
        out[name] = dict(names=mesh.mesh_dim_names, dp=(dp.mesh.tolist(), dp.mesh_dim_names),
                         cp=None if cpm is None else cpm.mesh.tolist())
        if name == "cp-tp":  # fully_shard composes TP through the root sliced by both names
            out[name]["dp_tp"] = mesh[("dp_shard_cp", "tp")].mesh.tolist()
            again = flatten_axes(mesh_axes(mesh).sub("dp_shard", "cp"), "dp_shard_cp")
            out[name]["same"] = again.mesh.tolist() == dp.mesh.tolist() and again.mesh_dim_names == dp.mesh_dim_names
    return out


def test_init_mesh_cp_axis_and_the_shard_axis_over_dp_shard_and_cp():
    for rank, got in enumerate(run_ranks(_meshes, 4, timeout=90)):
        assert got["no-cp"]["names"] == ("dp_replicate", "dp_shard", "tp") and got["no-cp"]["cp"] is None
        assert got["shard-cp"]["names"] == ("dp_replicate", "dp_shard", "cp", "tp")
        assert got["shard-cp"]["dp"] == ([0, 1, 2, 3], ("dp_shard_cp",)), got
        assert got["shard-cp"]["cp"] == [2 * (rank // 2), 2 * (rank // 2) + 1], got  # cp inner to dp_shard
        # cp=2, tp=2: dp_shard=1; cp ranks are 2 apart (tp innermost)
        assert got["cp-tp"]["dp"] == ([rank % 2, rank % 2 + 2], ("dp_shard_cp",)), got
        assert got["cp-tp"]["cp"] == [rank % 2, rank % 2 + 2] and got["cp-tp"]["same"], got
        assert got["cp-tp"]["dp_tp"] == [[0, 1], [2, 3]], got
        assert got["hsdp-cp"]["dp"] == ([[0, 1], [2, 3]], ("dp_replicate", "dp_shard_cp")), got  # dp_shard = 1


@settings(max_examples=120, deadline=None)
@given(local=st.sampled_from([2, 4, 8]), hosts=st.integers(2, 3), cp=st.sampled_from([2, 4]),
       tp=st.sampled_from([1, 2]), shard=st.sampled_from([1, 2, 4]))
def test_host_fit_counts_cp_in_the_block(local, hosts, cp, tp, shard):
    """`host_fit_problem` with a cp axis: the block a host must hold is ``dp_shard x cp x tp``
    (the parameters are sharded over dp_shard_cp, the ring crosses cp); the suggested shape,
    same cp and tp, fits."""
    import re

    from shardwise.mesh import host_fit_problem

    world = local * hosts
    if world % (shard * cp * tp):
        return
    dims = ParallelDims(dp_shard=shard, cp=cp, tp=tp, dp_replicate=-1, world_size=world)
    problem = host_fit_problem(dims, local)
    block = shard * cp * tp
    assert (problem is None) == (local % block == 0), (dims, problem)
    if problem is None:
        return
    assert f"dp_shard({shard}) * cp({cp}) * tp({tp}) = {block}" in problem, problem
    if local % (cp * tp):
        assert f"cp({cp}) * tp({tp}) does not divide local_world_size({local})" in problem, problem
        return
    rep, s, c, t = map(int, re.search(r"dp_replicate=(\d+), dp_shard=(\d+), cp=(\d+), tp=(\d+)", problem).groups())
    better = ParallelDims(dp_replicate=rep, dp_shard=s, cp=c, tp=t, world_size=world)
    assert (c, t) == (cp, tp) and host_fit_problem(better, local) is None, problem
