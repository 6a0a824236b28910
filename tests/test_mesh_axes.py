"""Every entry point finds its mesh axes by name (`mesh_axes`), wherever they sit: strategy_mesh
on the 4-D pipeline mesh and on meshes with other axes around the data-parallel ones,
data_parallel_mesh on reordered axes, and the one dp rule shared with ParallelDims."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwise.composable import strategy_mesh
from shardwise.mesh import ParallelDims, data_parallel_mesh, init_mesh
from tests._dist import run_ranks


def _ranks(mesh):
    return mesh.mesh.tolist(), mesh.mesh_dim_names


def _strategies(rank, world_size):
    out = {}
    pp_mesh = init_mesh(pp=2, dp_shard=2, device_type="cpu")  # ("pp", "dp_replicate", "dp_shard", "tp")
    out["full-4d"] = _ranks(strategy_mesh("FULL_SHARD", pp_mesh))
    out["dp-4d"] = _ranks(data_parallel_mesh(pp_mesh))
    out["no-shard-4d"] = _ranks(strategy_mesh("NO_SHARD", pp_mesh))
    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "pp"))  # pp innermost
    out["full-pp-inner"] = _ranks(strategy_mesh("SHARD_GRAD_OP", inner))
    hybrid = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("tp", "dp_replicate", "dp_shard"))
    out["hybrid-tp-outer"] = _ranks(strategy_mesh("HYBRID_SHARD", hybrid))
    out["dp-tp-outer"] = _ranks(data_parallel_mesh(hybrid))
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "dp_replicate"))
    try:
        data_parallel_mesh(swapped)
        out["swapped"] = None
    except ValueError as exc:
        out["swapped"] = str(exc)
    return out


def test_strategy_and_data_parallel_meshes_by_axis_name():
    for rank, got in enumerate(run_ranks(_strategies, 4, timeout=60)):
        stage = rank // 2
        assert got["full-4d"] == got["dp-4d"] == ([2 * stage, 2 * stage + 1], ("dp_shard",)), got
        assert got["no-shard-4d"] == ([[2 * stage], [2 * stage + 1]], ("dp_replicate", "dp_shard")), got
        assert got["full-pp-inner"] == ([rank % 2, rank % 2 + 2], ("dp_shard",)), got
        assert got["hybrid-tp-outer"] == got["dp-tp-outer"] == ([[0, 1], [2, 3]], ("dp_replicate", "dp_shard")), got
        assert got["swapped"] is not None and "needs them in that order" in got["swapped"], got["swapped"]


@pytest.mark.parametrize("replicate", [1, 2])
def test_parallel_dims_states_the_rule_data_parallel_mesh_slices(replicate):
    dims = ParallelDims(dp_replicate=replicate, world_size=4)
    got = run_ranks(_dp_names, 4, replicate, timeout=60)
    assert all(names == dims.dp_axis_names for names in got), (got, dims.dp_axis_names)


def _dp_names(rank, world_size, replicate):
    return data_parallel_mesh(init_mesh(dp_replicate=replicate, device_type="cpu")).mesh_dim_names
