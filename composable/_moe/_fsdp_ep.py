"""`fully_shard_experts`: EP x FSDP, the experts sharded over the data-parallel ranks left after ``ep``.

[Note: dividing expert gradients]
A dense gradient is the mean over the ``W`` data-parallel ranks. An expert's gradient is already
summed over its ep group (the all-to-all brought their tokens), so its unit reduces over the ``W /
ep`` ranks of ``ExpertMeshes.dp`` but must still divide by ``W``: `fully_shard_experts` sets that
divide factor, its one difference from ``fully_shard(experts, mesh=ExpertMeshes.dp)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.mesh import ExpertMeshes

from .._fsdp import FSDPModule, fully_shard
from ._experts import GroupedExperts
from ._layer import MoE

__all__ = ["fully_shard_experts"]


def fully_shard_experts(module: nn.Module, meshes: ExpertMeshes, **kwargs: Any) -> FSDPModule:
    """``fully_shard`` the experts of ``module`` (a `MoE` or its `GroupedExperts`, under
    `ExpertParallel`) over ``meshes.dp`` with the whole data-parallel divide factor ([Note:
    dividing expert gradients]); ``kwargs`` go to ``fully_shard``. Returns the unit; call it
    before ``fully_shard`` of the enclosing block."""
    if not isinstance(meshes, ExpertMeshes):
        raise TypeError(f"fully_shard_experts: meshes must be shardwise.mesh.ExpertMeshes (expert_meshes(mesh)), "
                        f"got {type(meshes).__name__}")
    target = module.experts if isinstance(module, MoE) else module
    if not isinstance(target, GroupedExperts):
        raise TypeError(f"fully_shard_experts: expected a MoE or GroupedExperts, got {type(module).__name__}")
    if "mesh" in kwargs:
        raise TypeError("fully_shard_experts: the mesh is meshes.dp; do not pass mesh=")
    unit = fully_shard(target, mesh=meshes.dp, **kwargs)
    unit.set_gradient_divide_factor(meshes.degree * meshes.dp_degree)
    return unit
