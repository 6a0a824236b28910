"""The one private torch API the pipeline needs, kept here (house rule: private APIs only in
compat modules).

A checkpoint must see every tensor of the unsplit model on every rank, with the same layout,
while only the ranks of one stage hold it ([Note: checkpoints of a split model] in
``_checkpoint.py``). For a tensor held by another stage we describe it as a DTensor on that
stage's mesh, which does not contain this rank: a ``DeviceMesh`` built with
``_init_backend=False`` names those ranks without creating process groups (no collective, no
communication ever happens on it), and this rank's coordinate on it is None, so it neither
writes nor reads any of that tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_without_groups"]


def mesh_without_groups(device_type: str, ranks: list, names: tuple[str, ...] | None) -> DeviceMesh:
    """A DeviceMesh over the global ``ranks`` (nested list) with no process groups."""
    return DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int64), mesh_dim_names=names,
                      _init_backend=False)
