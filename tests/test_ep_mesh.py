"""The ``ep`` size rule of `ParallelDims` and the expert mesh of `init_mesh(ep=N)` / `expert_meshes`."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.mesh import ParallelDims, data_parallel_mesh, expert_meshes, init_mesh
from tests._dist import run_ranks


@settings(deadline=None)
@given(dp_shard=st.integers(1, 12), ep=st.integers(1, 12), tp=st.integers(1, 3))
def test_ep_divides_dp_shard(dp_shard: int, ep: int, tp: int) -> None:
    world = dp_shard * tp
    if dp_shard % ep == 0:
        dims = ParallelDims(tp=tp, world_size=world, ep=ep)
        assert dims.dp_shard_mod_ep * ep == dp_shard
        assert dims.mesh_shape == (1, dp_shard, tp), "ep adds no ranks"
    else:
        msg = (f"ep({ep}) must divide dp_shard({dp_shard}) * cp(1) = {dp_shard}", f"{dp_shard} % {ep} = {dp_shard % ep}")
        with pytest.raises(ValueError, match=re.escape(msg[0]) + ".*" + re.escape(msg[1])):
            ParallelDims(tp=tp, world_size=world, ep=ep)


def test_ep_bad_values() -> None:
    with pytest.raises(ValueError, match="ep=0 is invalid"):
        ParallelDims(world_size=4, ep=0)
    with pytest.raises(ValueError, match="ep=-1 is invalid"):
        ParallelDims(world_size=4, ep=-1)
    with pytest.raises(TypeError, match="ep must be an int"):
        ParallelDims(world_size=4, ep=True)  # type: ignore[arg-type]


def test_ep_counts_cp_when_the_dims_have_it() -> None:
    """The rule reads ``cp`` where a ParallelDims has one (the context-parallel axis)."""
    from shardwise.mesh._ep_dims import check_ep, dp_shard_mod_ep

    class Dims:
        dp_shard, cp, ep = 2, 2, 4
    check_ep(Dims())
    assert dp_shard_mod_ep(Dims()) == 1
    Dims.ep = 3
    with pytest.raises(ValueError, match=re.escape("ep(3) must divide dp_shard(2) * cp(2) = 4")):
        check_ep(Dims())


def _meshes(rank, world, kwargs, ep):
    mesh = init_mesh(device_type="cpu", **kwargs, ep=ep)
    em = expert_meshes(mesh)
    assert expert_meshes(mesh) is em and expert_meshes(mesh, ep) is em, "kept with the mesh"
    dense = data_parallel_mesh(mesh)
    if world == 4 and ep == 2:  # an equal mesh built again with another degree: each degree kept
        again = init_mesh(device_type="cpu", **kwargs, ep=4)
        assert expert_meshes(again).degree == 4, "the degree init_mesh last built"
        assert expert_meshes(mesh, 2) is em and expert_meshes(again, 4).ep.size() == 4
    return (em.ep.mesh.tolist(), em.dp.mesh.tolist(), em.dp.mesh_dim_names, em.mesh.mesh_dim_names,
            dense.mesh.flatten().tolist(), em.dp_degree)


def test_expert_mesh_layout_4_ranks() -> None:
    out = run_ranks(_meshes, 4, {}, 2)
    # dp_shard = 4 -> dp_shard_mod_ep 2 x ep 2, ep inner (consecutive ranks)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert out[0][2] == ("dp_shard_mod_ep",)
    assert out[0][3] == ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    assert all(o[4] == [0, 1, 2, 3] and o[5] == 2 for o in out)


def test_expert_mesh_with_replicas_and_tp() -> None:
    out = run_ranks(_meshes, 8, {"dp_replicate": 2, "tp": 2}, 2)
    # mesh (2, 2, 2): dp_shard 2 = ep 2, dp_shard_mod_ep 1; ep peers differ by 2 (tp inner)
    assert [o[0] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert out[0][2] == ("dp_replicate", "dp_shard_mod_ep")
    assert out[0][1] == [[0], [4]] and out[5][1] == [[1], [5]]
    assert all(o[5] == 2 for o in out)


def _no_ep(rank, world):
    mesh = init_mesh(device_type="cpu")
    try:
        expert_meshes(mesh)
    except ValueError as e:
        return str(e)
    return None


def test_expert_meshes_needs_a_degree() -> None:
    assert all("pass ep=N" in (m or "") for m in run_ranks(_no_ep, 2))


def test_ep_over_dp_shard_times_cp_with_the_real_cp_axis() -> None:
    """With the context-parallel axis merged in, ``ep`` divides ``dp_shard * cp``."""
    dims = ParallelDims(dp_shard=2, cp=2, world_size=4, ep=4)
    assert dims.dp_shard_mod_ep == 1 and dims.mesh_shape == (1, 2, 2, 1)
    with pytest.raises(ValueError, match=re.escape("ep(8) must divide dp_shard(2) * cp(2) = 4")):
        ParallelDims(dp_shard=2, cp=2, world_size=4, ep=8)
