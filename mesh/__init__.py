"""Device meshes for sharded training: ``[pp x] dp_replicate`` x ``dp_shard`` x ``tp``.

Typical script (launched with ``torchrun --nproc-per-node=N train.py``)::

    from shardwise.mesh import init_distributed, init_mesh, data_parallel_mesh

    init_distributed()                      # default process group from torchrun env
    mesh = init_mesh(tp=2)                  # dp_shard = world_size // 2
    dp_mesh = data_parallel_mesh(mesh)      # what fully_shard takes
    tp_mesh = mesh["tp"]                    # what tensor parallelism takes

docs/mesh.md describes the axes and every entry point.
"""

from ._axes import DP_SHARD_CP, MeshAxes, mesh_axes
from ._bytes import byte_layout  # shared with the other packages (not a public name)
from ._dims import AXIS_NAMES, CP_AXIS, PP_AXIS, ParallelDims
from ._ep import EP_AXIS, EP_DP_AXIS, ExpertMeshes, expert_meshes
from ._hosts import HostLayoutWarning, host_fit_problem
from ._init import (cp_mesh, data_parallel_mesh, default_backend, default_device_type, init_distributed, init_mesh,
                    pipeline_mesh)

__all__ = ["AXIS_NAMES", "CP_AXIS", "DP_SHARD_CP", "cp_mesh", "EP_AXIS", "EP_DP_AXIS", "ExpertMeshes", "expert_meshes",
           "PP_AXIS", "HostLayoutWarning", "MeshAxes", "ParallelDims", "data_parallel_mesh", "default_backend",
           "default_device_type", "host_fit_problem", "init_distributed", "init_mesh", "mesh_axes", "pipeline_mesh"]
