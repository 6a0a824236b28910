"""Small helpers about meshes and collectives shared by the composable modules."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_device", "same_mesh", "all_gather_single", "reduce_scatter_single", "all_to_all_single"]

# The flat-tensor collectives, looked up in ``torch.distributed`` at each call (so that a spy
# set there sees every call).


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """``output`` = the concatenation of every rank's ``input`` (in group rank order)."""
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                          async_op: bool = False) -> dist.Work | None:
    """``output`` on rank ``r`` = the sum over ranks of chunk ``r`` of their ``input``."""
    return dist.reduce_scatter_single(output, input, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """``input``'s ``input_split_sizes[r]`` consecutive rows go to group rank ``r``; ``output``
    receives ``output_split_sizes[s]`` rows from each rank ``s``, in rank order."""
    return dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the current accelerator of the mesh's type, or CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether ``a`` and ``b`` are the same mesh *by value*: device type, axis names and rank
    layout. Never compare meshes by identity: building an equal mesh again (a second model, an
    evaluation job, a process reused by tests) gives a new object, and DTensor's caches may
    hand back either."""
    if a is b:
        return True
    return (a.device_type == b.device_type and a.mesh_dim_names == b.mesh_dim_names
            and tuple(a.mesh.shape) == tuple(b.mesh.shape) and torch.equal(a.mesh, b.mesh))
