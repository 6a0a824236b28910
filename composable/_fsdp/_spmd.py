"""``fully_shard(mesh=whole_mesh, dp_mesh_dims=...)``: the data-parallel mesh and the
parameters' tensor-parallel form taken out of a whole SPMD mesh.

With ``dp_mesh_dims`` the mesh is the whole job's (say ``("dp", "tp")``) and the parameters are
DTensors on it, ``Replicate()`` on the data-parallel axes (as after ``parallelize_module`` on the
whole mesh). fully_shard works on the data-parallel submesh and sees each parameter as a DTensor
on the remaining axis ([Note: sharding a tensor-parallel parameter] in ``_tp_param.py``); the
sharded parameters' ``full_tensor()`` gives the global tensor whatever the axis order.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .._compat import concatenate_meshes, flatten_mesh
from ._policies import DataParallelMeshDims

__all__ = ["spmd_mesh", "to_tp_dtensor"]


def _check(mesh: DeviceMesh, dims: DataParallelMeshDims) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("fully_shard: dp_mesh_dims needs a mesh with axis names (build it with "
                         "shardwise.mesh.init_mesh or init_device_mesh(..., mesh_dim_names=...))")
    shard, rep = dims.shard_names, dims.replicate_names
    for role, given in (("shard", shard), ("replicate", rep)):
        missing = [n for n in given if n not in names]
        if missing:
            raise ValueError(f"fully_shard: dp_mesh_dims.{role} names {missing}, not axes of the mesh {names}")
    if set(shard) & set(rep):
        raise ValueError(f"fully_shard: dp_mesh_dims uses axis {sorted(set(shard) & set(rep))} for both shard and "
                         "replicate")
    return shard, rep


def spmd_mesh(mesh: DeviceMesh, dims: DataParallelMeshDims) -> DeviceMesh:
    """The data-parallel submesh: ``(replicate, shard)`` (HSDP), ``(shard,)``; replicate alone
    is NO_SHARD, a 1-rank shard axis is not available here, so it is refused. A role naming
    several axes gets one axis over them all, called ``"_".join(names)`` (as torch 2.13's)."""
    shard, rep = _check(mesh, dims)
    if not shard:
        raise NotImplementedError("fully_shard: dp_mesh_dims with replicate only (DDP) is not supported; use "
                                  "shardwise.composable.apply_fully_shard(..., 'NO_SHARD') or name a shard axis")
    if len(shard) == 1 and len(rep) <= 1:
        return mesh[rep + shard]
    one = [mesh[names] if len(names) == 1 else flatten_mesh(mesh[names], "_".join(names)) for names in (rep, shard)
           if names]
    return concatenate_meshes(one) if len(one) == 2 else one[0]


def to_tp_dtensor(param: torch.Tensor, fqn: str, dims: DataParallelMeshDims) -> torch.Tensor:
    """``param`` (a DTensor on the whole mesh, replicated on the data-parallel axes) as a
    DTensor on its one remaining axis, or its local tensor when every axis is data-parallel."""
    if not isinstance(param, DTensor):
        raise ValueError(f"fully_shard: with dp_mesh_dims, parameter '{fqn}' must be a DTensor on the mesh "
                         "(distribute it first, e.g. parallelize_module(model, mesh, plan) or distribute_tensor)")
    mesh = param.device_mesh
    shard, rep = _check(mesh, dims)
    dp = set(shard) | set(rep)
    names = mesh.mesh_dim_names or ()
    bad = [n for n, pl in zip(names, param.placements) if n in dp and not isinstance(pl, Replicate)]
    if bad:
        raise ValueError(f"fully_shard: parameter '{fqn}' has placements {tuple(param.placements)} on mesh axes "
                         f"{names}; with dp_mesh_dims it must be Replicate() on the data-parallel axes {bad}")
    rest = [(n, pl) for n, pl in zip(names, param.placements) if n not in dp]
    local = param.to_local().detach()
    if not rest:
        out = local
    elif len(rest) == 1:
        out = DTensor.from_local(local, mesh[rest[0][0]], [rest[0][1]], run_check=False,
                                 shape=param.shape, stride=param.stride())
    else:
        raise NotImplementedError(f"fully_shard: parameter '{fqn}' is distributed over {len(rest)} non-data-parallel "
                                  f"axes {[n for n, _ in rest]}; fully_shard composes with one tensor-parallel axis")
    return out.requires_grad_(param.requires_grad)
