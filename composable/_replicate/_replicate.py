"""``replicate``: data parallelism with whole, plain parameters on every rank (DDP's way).

The composable counterpart of ``DistributedDataParallel``: the module's class gains
`ReplicateModule`'s methods and its parameters stay plain ``nn.Parameter``s, so the optimizer
steps plain tensors (as fast as DDP, where ``fully_shard`` on a ``(D, 1)`` mesh is not:
docs/benchmarks.md). NO_SHARD of `apply_fully_shard` uses it when nothing needs a per-unit cast
or offload (docs/strategies.md).

* ``mesh``: None (every rank), 1-D, or ``(D, 1)``; a second axis of more ranks is HSDP (refused).
* Parameters and buffers are broadcast from the mesh's first rank (``sync_module_states=False``
  skips it).
* In backward gradients are summed over the ranks in buckets ([Note: replicate's buckets]), each
  divided by ``D`` first (`ReplicateModule.set_gradient_divide_factor`); a parameter no rank had a
  gradient for keeps ``.grad`` None.
* Refused with a ValueError naming the fix: meta parameters, DTensor parameters (use
  `fully_shard`), a module replicated or fully_shard'ed already.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._fsdp import FSDPModule
from ._buckets import plan_buckets
from ._module import ReplicateModule
from ._state import STATE_ATTR, ReplicateState, get_replicate_state

__all__ = ["replicate"]


def _group(mesh: DeviceMesh | None) -> tuple[dist.ProcessGroup, int, int]:
    """(process group, its size, the global rank broadcasts come from)."""
    if not dist.is_initialized():
        raise RuntimeError("replicate: no default process group; call shardwise.mesh.init_distributed() "
                           "(or torch.distributed.init_process_group) on every rank first")
    if mesh is None:
        group = dist.group.WORLD
        assert group is not None
        return group, dist.get_world_size(), 0
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"replicate: mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim == 2 and mesh.size(1) != 1:
        raise ValueError(f"replicate: the mesh {tuple(mesh.shape)} shards over its second axis; replicate keeps whole "
                         "parameters on every rank: pass a 1-D or (D, 1) mesh, or use fully_shard for HSDP")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"replicate: got a {mesh.ndim}-D mesh; pass a 1-D or (D, 1) data-parallel mesh "
                         "(shardwise.composable.strategy_mesh('NO_SHARD', mesh) gives one)")
    group = mesh.get_group(0)
    return group, mesh.size(0), int(mesh.mesh.flatten()[0])


def replicate(module: nn.Module, mesh: DeviceMesh | None = None, *, bucket_cap_mb: float = 25.0,
              first_bucket_cap_mb: float = 1.0, sync_module_states: bool = True) -> nn.Module:
    """Replicate ``module`` over ``mesh`` (see the module docstring). Call it on every rank,
    before building the optimizer. Returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate: expected an nn.Module, got {type(module).__name__}")
    if get_replicate_state(module) is not None:
        raise ValueError(f"replicate: {type(module).__name__} is replicated already; call replicate once per model")
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError(f"replicate: {type(module).__name__} holds fully_shard units; replicate a model that "
                         "fully_shard has not touched, or use fully_shard on a (D, 1) mesh for all of it")
    named = list(module.named_parameters())
    meta = [n for n, p in named if p.is_meta]
    if meta:
        raise ValueError(f"replicate: parameters still on the meta device ({', '.join(meta[:3])}"
                         f"{', ...' if len(meta) > 3 else ''}); materialize them first (to_empty + init, "
                         "or shardwise.composable.materialize)")
    dt = [n for n, p in named if isinstance(p, DTensor)]
    if dt:
        raise ValueError(f"replicate: {dt[0]} is a DTensor (tensor parallelism?); replicate keeps plain parameters. "
                         "Use fully_shard over the data-parallel mesh for TP models")
    group, world, src = _group(mesh)
    if sync_module_states and world > 1:
        with torch.no_grad():
            for t in [p.detach() for _, p in named] + [b for b in module.buffers()]:
                dist.broadcast(t, src=src, group=group)
    params = list(dict.fromkeys(p for _, p in named if p.requires_grad))  # shared ones once
    buckets = plan_buckets(params, int(bucket_cap_mb * (1 << 20)), int(first_bucket_cap_mb * (1 << 20)))
    setattr(module, STATE_ATTR, ReplicateState(buckets, group, world))
    cls = module.__class__
    module.__class__ = type(f"Replicate{cls.__name__}", (ReplicateModule, cls), {})
    return module
