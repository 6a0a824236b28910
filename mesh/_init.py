"""Process-group and device-mesh setup on torch's public DeviceMesh API."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._axes import mesh_axes
from ._dims import CP_AXIS, PP_AXIS, ParallelDims
from ._ep import remember_expert_meshes
from ._hosts import HostLayoutWarning, host_fit_problem

__all__ = ["data_parallel_mesh", "default_backend", "default_device_type", "init_distributed", "init_mesh",
           "pipeline_mesh", "cp_mesh"]

_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_device_type() -> str:
    """``"cuda"`` if ``torch.cuda.is_available()``, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device_type: str | None = None) -> str:
    """The process-group backend for a device type: cuda -> nccl, cpu -> gloo.

    ``device_type`` defaults to `default_device_type()`. Raises ``ValueError`` for other device
    types (pass the backend explicitly instead).
    """
    device_type = default_device_type() if device_type is None else device_type
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"no default backend for device_type={device_type!r} (known: {sorted(_BACKENDS)}); pass "
                         "backend= explicitly") from None


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialize the default process group for a script; return ``(rank, world_size)``.

    * Already initialized: nothing is re-initialized; returns its rank and size.
    * torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` all set):
      ``env://`` rendezvous with ``backend`` (default: `default_backend()` of
      `default_device_type()`) and a ``timeout_s`` collective timeout. With cuda, first selects
      ``cuda:LOCAL_RANK`` (default 0) and, for nccl, binds the group to it.
    * None of those variables set (plain ``python script.py``): a one-rank group on an in-memory
      store, so the same script runs unlaunched.
    * Only some set: ``RuntimeError`` naming the missing ones.
    """
    if not dist.is_available():
        raise RuntimeError("init_distributed(): this torch build has no torch.distributed support; install a torch "
                           "build with distributed enabled")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    device_type = default_device_type()
    backend = default_backend(device_type) if backend is None else backend
    timeout = timedelta(seconds=timeout_s)
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if not present:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed(): {', '.join(present)} set but {', '.join(missing)} unset; launch with "
                           f"`torchrun --nproc-per-node=N script.py`, which sets all of {', '.join(_TORCHRUN_VARS)}")
    device_id = None
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        if backend == "nccl":
            device_id = torch.device("cuda", local_rank)
    dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    return dist.get_rank(), dist.get_world_size()


def init_mesh(*, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, pp: int = 1, cp: int = 1,
              device_type: str | None = None, world_size: int | None = None, ep: int = 1) -> DeviceMesh:
    """Build the 3-D ``("dp_replicate", "dp_shard", "tp")`` DeviceMesh, or with ``pp > 1`` the 4-D
    ``("pp", "dp_replicate", "dp_shard", "tp")`` one.

    Call on every rank, after the default process group is initialized (or `init_distributed()`).
    All three axes always exist, size-1 ones included. Ranks are row-major, ``tp`` innermost:
    world 8 with ``dp_replicate=2, tp=2`` gives ``[[[0,1],[2,3]],[[4,5],[6,7]]]``. With ``pp > 1``
    the ``pp`` axis is outermost (stage ``s`` is ranks ``s * stage_size .. (s + 1) * stage_size -
    1``, so only the pipeline's activations cross hosts).

    Args:
        dp_replicate, dp_shard, tp: axis sizes as in `ParallelDims` (one may be -1; ``dp_shard``
            is by default).
        pp: pipeline stages, a positive int (default 1: no ``pp`` axis).
        cp: context-parallel ranks, a positive int (default 1: no ``cp`` axis); with ``cp > 1`` a
            ``cp`` axis sits between ``dp_shard`` and ``tp`` (``("dp_replicate", "dp_shard",
            "cp", "tp")``, `cp_mesh` slices it) and `data_parallel_mesh` shards over ``dp_shard``
            x ``cp`` flattened.
        device_type: defaults to `default_device_type()`; ``"cpu"``, or an accelerator type torch
            has and finds available here (``"cuda"`` needs ``torch.cuda.is_available()``).
        world_size: defaults to the default group's size; when given, it must equal it (a check
            that the launch matches the intended size).
        ep: expert-parallel degree (default 1). Adds no axis to the returned mesh: with ``ep > 1``
            the expert mesh is built here too (collective) and ``expert_meshes(mesh)`` returns it
            (docs/expert_parallel.md).

    Raises:
        RuntimeError: no default process group.
        ValueError: invalid sizes (the message shows the arithmetic), ``world_size`` differs from
            the group's, or a ``device_type`` this host cannot use.

    On a multi-host torchrun job rank 0 emits `HostLayoutWarning` (a ``UserWarning``) if a
    ``dp_shard * tp`` block of ranks does not fit in one host (`host_fit_problem`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_mesh() needs the default process group, which is not initialized: launch with "
                           "`torchrun --nproc-per-node=N script.py` and call torch.distributed.init_process_group() "
                           "first, or call shardwise.mesh.init_distributed(), which initializes it from torchrun's "
                           "environment")
    group_size = dist.get_world_size()
    if world_size is None:
        world_size = group_size
    elif world_size != group_size:
        raise ValueError(f"init_mesh(world_size={world_size}) but the default process group has {group_size} ranks; "
                         f"launch {world_size} ranks or drop world_size=")
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, world_size=world_size,
                        ep=ep)
    # Checked on every rank so a bad LOCAL_WORLD_SIZE fails everywhere (no hang).
    problem = host_fit_problem(dims, _local_world_size_from_env())
    if problem is not None and dist.get_rank() == 0:
        warnings.warn(problem, HostLayoutWarning, stacklevel=2)
    device_type = default_device_type() if device_type is None else _check_device_type(device_type)
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.axis_names)
    if dims.ep > 1:  # expert parallelism: the expert mesh, built once on every rank (mesh/_ep.py)
        remember_expert_meshes(mesh, dims.ep)
    return mesh


def _check_device_type(device_type: object) -> str:
    """``device_type`` if this host can build a mesh on it, else a one-line ``ValueError``."""
    if not isinstance(device_type, str):
        raise TypeError(f"init_mesh(device_type={device_type!r}): pass a device type string such as 'cpu' or "
                        "'cuda', or None for default_device_type()")
    if device_type == "cpu":
        return device_type
    module = getattr(torch, device_type, None)
    available = getattr(module, "is_available", None)
    if not callable(available):
        raise ValueError(f"init_mesh(device_type={device_type!r}): not a device type torch knows here; use 'cpu' or "
                         f"'cuda', or None for default_device_type() ({default_device_type()!r} on this host)")
    if not available():
        raise ValueError(f"init_mesh(device_type={device_type!r}): torch.{device_type}.is_available() is False on "
                         f"this host; use device_type='cpu', or None for default_device_type() "
                         f"({default_device_type()!r} here)")
    return device_type


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh that ``fully_shard`` takes, from an `init_mesh` mesh (or any mesh with
    ``dp_replicate`` and ``dp_shard`` axes, in any order).

    ``mesh["dp_shard"]`` (1-D, FSDP) when the ``dp_replicate`` axis has size 1, else
    ``mesh["dp_replicate", "dp_shard"]`` (2-D, HSDP; `ParallelDims.dp_axis_names`).
    With a ``cp`` axis of size > 1 (``init_mesh(cp=N)``), ``dp_shard`` is replaced by
    ``dp_shard_cp``: ``dp_shard`` x ``cp`` flattened (``MeshAxes.shard_axis_with_cp``).
    Raises ``ValueError`` if the mesh lacks either axis name.
    """
    return mesh_axes(mesh, "dp_replicate", "dp_shard", caller="data_parallel_mesh()").data_parallel()


def _local_world_size_from_env() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} in the environment is not an int; unset it or launch with "
                         "torchrun, which sets it") from None


def pipeline_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D ``pp`` sub-mesh of an `init_mesh` mesh, or of any mesh with a ``pp`` axis
    wherever it sits (the ranks of this rank's pipeline, one per stage), or None when the mesh
    has no ``pp`` axis (``pp == 1``)."""
    axes = mesh_axes(mesh, caller="pipeline_mesh()")
    return axes.sub(PP_AXIS) if axes.has(PP_AXIS) else None


# -- context parallelism (issue 25)
def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D ``cp`` sub-mesh of an `init_mesh` mesh (the ranks that share this rank's samples
    and split their sequence), or None when the mesh has no ``cp`` axis (``cp == 1``)."""
    axes = mesh_axes(mesh, caller="cp_mesh()")
    return axes.sub(CP_AXIS) if axes.has(CP_AXIS) else None
