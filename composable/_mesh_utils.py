"""Small helpers about meshes shared by the composable modules."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_device"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the current accelerator of the mesh's type, or CPU."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())
