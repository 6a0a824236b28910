"""The layout of a tensor-parallel parameter under ``fully_shard``: the combined ``(dp..., tp)``
mesh and placements of its sharded DTensor.

[Note: sharding a tensor-parallel parameter]
A TP parameter is a DTensor on a 1-D ``tp`` mesh (or the 2-D ``(ep, tp)`` slice for experts)
whose local tensor is this rank's TP piece. fully_shard shards that *local* tensor along dim 0
over the data-parallel axes: the layout arithmetic is on the TP-local shape and the collectives
run within each data-parallel group. The sharded parameter is a DTensor on the combined
``(dp..., tp)`` mesh: if TP split dim 0 too (colwise weights) the dp axis is a strided shard
(``_compat.strided_shard(0, s)``, ``s`` the product of the TP axes splitting dim 0), else a
plain ``Shard(0)``; so ``full_tensor()`` gives the global tensor. The unsharded parameter is a
DTensor on the ``tp`` mesh, as the TP module code expects; its gradient is redistributed to the
parameter's TP placement (the all-reduce of a ``Partial`` gradient) in its own dtype and then
cast to ``reduce_dtype``, in FSDP2's order, so bf16 ``SequenceParallel`` norm gradients match
torch's to the bit (docs/tensor_parallel.md, "bf16 and torch").
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from .._compat import concatenate_meshes, strided_shard

__all__ = ["tp_sharded_placements"]


def tp_sharded_placements(dp_mesh: DeviceMesh, dp: tuple[Placement, ...], placement: Shard,
                          param: DTensor) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """``(mesh, placements)`` of the sharded form of the TP DTensor ``param``: ``dp`` (the
    data-parallel placements, sharding ``placement``'s dim) followed by ``param``'s TP
    placements, on the combined mesh; the dp shard is strided when TP split the same dim first."""
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    split = 1  # how many pieces the TP axes cut the dp-sharded dim into (1: none)
    for i, pl in enumerate(tp_placements):
        if pl == placement:
            split *= tp_mesh.size(i)
    if split > 1:  # TP split the same dim first
        dp = dp[:-1] + (strided_shard(placement.dim, split),)
    return _combined_mesh(dp_mesh, tp_mesh), dp + tp_placements


def _combined_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The ``(dp axes..., tp axes...)`` mesh of the mesh both were sliced from (as torch's
    FSDP2 builds it: named slices of one mesh, or of one ``_unflatten`` of a world mesh)."""
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    if dp_names and tp_names and set(dp_names) & set(tp_names):
        raise ValueError(f"fully_shard: the dp mesh {dp_names} and the TP mesh {tp_names} share an axis")
    if dp_names and tp_names:
        try:
            return concatenate_meshes([dp_mesh, tp_mesh])
        except RuntimeError:  # different meshes (by value), or overlapping ones
            pass
    raise ValueError(
        "fully_shard: a tensor-parallel parameter needs the data-parallel mesh and its TP mesh to be named "
        "slices of one mesh, e.g. mesh = init_mesh(dp_shard=2, tp=2); parallelize_module(m, mesh['tp'], plan); "
        f"fully_shard(m, mesh=data_parallel_mesh(mesh)). Got dp axes {dp_names} and tp axes {tp_names}."
        + (" Expert-parallel experts: call shardwise.composable.fully_shard_experts(moe, expert_meshes(mesh)) "
           "before fully_shard of the enclosing module (docs/expert_parallel.md)." if "ep" in (tp_names or ())
           else "")
    )
