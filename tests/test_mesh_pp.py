"""Tests of the ``pp`` axis of `shardwise.mesh`: sizes, host hints, a real 4-D mesh."""

from __future__ import annotations

import math
import re

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.mesh import AXIS_NAMES, ParallelDims, data_parallel_mesh, host_fit_problem, init_mesh, pipeline_mesh
from tests._dist import run_ranks

SIZES = st.integers(min_value=1, max_value=6)


@settings(deadline=None)
@given(pp=SIZES, dp_replicate=SIZES, dp_shard=SIZES, tp=SIZES, infer=st.booleans())
def test_pp_sizes_resolve(pp, dp_replicate, dp_shard, tp, infer) -> None:
    world = pp * dp_replicate * dp_shard * tp
    dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=-1 if infer else dp_shard, tp=tp,
                        world_size=world)
    assert dims.dp_shard == dp_shard
    assert dims.stage_size == dp_replicate * dp_shard * tp
    if pp == 1:  # exactly the 3-D mesh of before
        assert dims.mesh_shape == (dp_replicate, dp_shard, tp) and dims.axis_names == AXIS_NAMES
    else:
        assert dims.mesh_shape == (pp, dp_replicate, dp_shard, tp)
        assert dims.axis_names == ("pp", *AXIS_NAMES)
    assert math.prod(dims.mesh_shape) == world


def test_pp_errors_show_arithmetic() -> None:
    with pytest.raises(ValueError, match=re.escape("pp(2) * dp_replicate(1) * dp_shard(3) * tp(1) = 6 != world_size(8)")):
        ParallelDims(pp=2, dp_shard=3, world_size=8)
    with pytest.raises(ValueError, match=re.escape("dp_shard=-1 cannot be resolved: world_size(8) is not divisible by "
                                                   "pp(3) * dp_replicate(1) * tp(1) = 3")):
        ParallelDims(pp=3, world_size=8)
    with pytest.raises(ValueError, match="pp=-1 is invalid"):
        ParallelDims(pp=-1, world_size=8)
    with pytest.raises(TypeError, match="pp must be an int"):
        ParallelDims(pp=2.0, world_size=8)


def test_pp_host_hint() -> None:
    # 2 hosts of 4, pp=2: each stage is one host; a dp_shard*tp block of 4 fits -> nothing to say
    assert host_fit_problem(ParallelDims(pp=2, dp_shard=4, world_size=8), 4) is None
    # 4 hosts of 2, pp=2, dp_shard=4: blocks of 4 span two hosts; suggest replicating per stage
    msg = host_fit_problem(ParallelDims(pp=2, dp_shard=4, world_size=8), 2)
    assert msg is not None and "pp=2, dp_replicate=2, dp_shard=2" in msg, msg


def _mesh_4d(rank, world_size):
    mesh = init_mesh(pp=2, dp_shard=1, tp=2)
    pp = pipeline_mesh(mesh)
    out = {"names": mesh.mesh_dim_names, "shape": tuple(mesh.shape), "ranks": mesh.mesh.tolist(),
           "pp": dist.get_process_group_ranks(pp.get_group()),
           "dp": dist.get_process_group_ranks(data_parallel_mesh(mesh).get_group()),
           "tp": dist.get_process_group_ranks(mesh["tp"].get_group()),
           "plain": pipeline_mesh(init_mesh(dp_shard=-1)) is None}
    return out


def test_init_mesh_pp_layout() -> None:
    got = run_ranks(_mesh_4d, 4, timeout=90)
    for r, g in enumerate(got):
        assert g["names"] == ("pp", "dp_replicate", "dp_shard", "tp")
        assert g["shape"] == (2, 1, 1, 2)
        assert g["ranks"] == [[[[0, 1]]], [[[2, 3]]]]
        assert g["pp"] == [r % 2, r % 2 + 2]  # pp outermost: stage s is ranks 2s..2s+1
        assert g["dp"] == [r]
        assert g["tp"] == [r - r % 2, r - r % 2 + 1]
        assert g["plain"]
