"""What one ``fully_shard`` call takes, checked: the mesh, ``reshard_after_forward``, the
unit's parameters (each once, those of nested units left out), the placement
``shard_placement_fn`` gives each, and the unit's buffers moved to the mesh's device. Every bad
input is one line naming it and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._compat import is_strided_shard
from .._mesh_utils import mesh_device, same_mesh
from ._common import OWNER_ATTR, FullyShardUsageError, ParamEntry
from ._state import get_state

__all__ = ["default_mesh", "check_mesh", "check_reshard_after_forward", "collect_params", "check_params",
           "shard_placement", "move_buffers"]


def default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: launch with torchrun and call "
            "torch.distributed.init_process_group (or shardwise.mesh.init_distributed), "
            "or pass mesh= explicitly"
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.group.WORLD
    assert world is not None, "initialized above"
    return DeviceMesh.from_group(world, device_type)


def check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim in (1, 2):
        return
    names = mesh.mesh_dim_names
    head = f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}"  # FSDP2's words, for code matching them
    if names is None:
        raise ValueError(
            f"{head}: a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} without axis names. fully_shard takes the "
            "data-parallel mesh (1-D shard, or 2-D replicate x shard). Name the axes (build it with "
            "shardwise.mesh.init_mesh) and pass shardwise.mesh.data_parallel_mesh(mesh)."
        )
    raise ValueError(
        f"{head}: a {mesh.ndim}-D mesh with axes {names}; it takes the data-parallel mesh (1-D shard, or 2-D "
        "replicate x shard), e.g. mesh['dp_replicate', 'dp_shard'] or shardwise.mesh.data_parallel_mesh(mesh)."
    )


def check_reshard_after_forward(value: object, mesh: DeviceMesh) -> bool | int | None:
    """``reshard_after_forward`` checked against the shard axis of ``mesh``; ``k == W`` is True,
    ``k == 1`` False."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        world = mesh.size(mesh.ndim - 1)
        if value < 1 or world % value != 0:
            raise ValueError(
                f"reshard_after_forward={value}: an int must divide the shard axis size {world} "
                f"(1 <= k <= {world}, {world} % k == 0)"
            )
        return True if value == world else (False if value == 1 else value)
    raise TypeError(f"reshard_after_forward must be None, a bool or an int, got {type(value).__name__}")


def collect_params(modules: list[nn.Module], ignored: set[int]) -> list[ParamEntry]:
    """``[(fqn, param, uses)]`` of the parameters this unit takes: those under ``modules`` that
    are not under an existing unit, not ignored, each once however many names it has."""
    by_id: dict[int, tuple[str, nn.Parameter, list]] = {}
    order: list[int] = []

    def visit(mod: nn.Module, prefix: str, top: bool) -> None:
        if not top and get_state(mod) is not None:
            return  # a nested unit owns this subtree
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            owner = getattr(p, OWNER_ATTR, None)
            if owner is not None:
                raise ValueError(  # torch 2.13's words (it refuses at the first forward), then the unit
                    f"fully_shard: parameter '{fqn}' is shared with a parameter already managed by another FSDP "
                    f"group: {owner}. For shared/tied parameters, use fully_shard([module_a, module_b]) to place "
                    "them in the same FSDP group (e.g. fully_shard([embedding, head])), or call fully_shard on their "
                    "common ancestor (often the root) instead of on the submodule: two units would all-gather and "
                    "reduce it twice and it would go stale."
                )
            if id(p) not in by_id:
                by_id[id(p)] = (fqn, p, [])
                order.append(id(p))
            by_id[id(p)][2].append((mod, name))
        for cname, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", False)

    for i, m in enumerate(modules):
        visit(m, "" if len(modules) == 1 else f"[{i}].", True)
    return [by_id[i] for i in order]


def check_params(entries: list[ParamEntry], mesh: DeviceMesh, label: str) -> None:
    for fqn, p, _ in entries:
        if isinstance(p, DTensor) and not all(
                isinstance(x, (Shard, Replicate)) and not is_strided_shard(x) for x in p.placements):
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is a DTensor with placements {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh; fully_shard composes with tensor parallelism on a 'tp' mesh "
                "(or expert x tensor parallelism on ('ep', 'tp')) with Shard or Replicate placements. Apply tensor parallelism first, then fully_shard on the "
                "data-parallel mesh."
            )
        if not p.is_floating_point():
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters are "
                "sharded. Register it as a buffer (module.register_buffer) or pass it in ignored_params."
            )
        if p.dim() == 0:
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is 0-d and has no dim 0 to shard. Change {fqn} to a 1D "
                "tensor with numel equal to 1 (shape (1,)), or pass it in ignored_params."
            )
        # CPU parameters move to an accelerator mesh's device (a model built on CPU, as with FSDP2);
        # any other mismatch is a mistake.
        if p.device.type not in (mesh.device_type, "meta", "cpu"):
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is on device '{p.device.type}' but the mesh is "
                f"'{mesh.device_type}'. Move the module first (module.to('{mesh.device_type}')) or build the mesh "
                f"for '{p.device.type}'."
            )


def shard_placement(fn: Callable[[Any], Any] | None, fqn: str, param: torch.Tensor, label: str,
                    mesh: DeviceMesh) -> Shard | None:
    """What ``shard_placement_fn`` says for ``param``, checked (None: ``Shard(0)``). torch 2.13's
    ``ShardPlacementResult(placement, mesh_info)`` is taken when ``mesh_info.mesh`` is the unit's
    ``mesh``; a parameter on a mesh of its own is refused (one mesh per unit, for now)."""
    if fn is None:
        return None
    placement = fn(param)
    if hasattr(placement, "mesh_info") and hasattr(placement, "placement"):  # a ShardPlacementResult
        own = getattr(placement.mesh_info, "mesh", None)
        if not isinstance(own, DeviceMesh) or not same_mesh(own, mesh):
            raise NotImplementedError(
                f"fully_shard({label}): shard_placement_fn put '{fqn}' on its own mesh {own}; shardwise shards "
                f"a unit over one mesh ({mesh}). Shard the module holding it first as a unit of its own on "
                "that mesh (e.g. fully_shard(moe.experts, mesh=ep_folded_mesh)), then this one")
        placement = placement.placement
    if placement is None:
        return None
    if not isinstance(placement, Shard) or is_strided_shard(placement):
        raise TypeError(f"fully_shard({label}): shard_placement_fn returned {placement!r} for '{fqn}'; return "
                        "torch.distributed.tensor.Shard(dim), None (Shard(0)) or a ShardPlacementResult on the "
                        "unit's mesh")
    ndim = (param.to_local() if isinstance(param, DTensor) else param).dim()
    if not -ndim <= placement.dim < ndim:
        raise FullyShardUsageError(
            f"fully_shard({label}): shard_placement_fn returned Shard({placement.dim}) for '{fqn}' of shape "
            f"{tuple(param.shape)}: Shard dim {placement.dim} is invalid for {ndim}D tensor; return a dim in "
            f"[-{ndim}, {ndim - 1}] (or None for Shard(0))")
    return Shard(placement.dim % ndim)


def move_buffers(modules: list[nn.Module], mesh: DeviceMesh, dtype: torch.dtype | None) -> None:
    """Move the unit's CPU buffers (not those of nested units) to the mesh's device and cast
    its floating-point buffers to ``MixedPrecisionPolicy.buffer_dtype`` when set."""
    device = mesh_device(mesh)
    stack = list(modules)
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is None or b.device.type == "meta":
                continue
            to_device = device if b.device.type == "cpu" and device.type != "cpu" else b.device
            to_dtype = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if (to_device, to_dtype) != (b.device, b.dtype):
                m._buffers[name] = b.to(device=to_device, dtype=to_dtype)
        stack.extend(c for c in m._modules.values() if c is not None and get_state(c) is None)
