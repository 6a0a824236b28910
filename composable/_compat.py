"""The torch private APIs that ``shardwise.composable`` relies on, in one place.

Each helper names what it uses; ``tests/test_dropin_compat.py`` checks that the behaviour we
rely on still holds for the installed torch, so an upgrade that changes it fails there first.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["set_local_tensor", "root_mesh", "run_eagerly", "_StridedShard"]

# ``_StridedShard(dim, split_factor=s)``: the placement of a mesh axis that shards ``dim`` *within*
# each of ``s`` chunks made by a later axis (FSDP over a TP-sharded dim 0). Relied on: its
# constructor, ``isinstance`` checks, and ``full_tensor()`` / redistribute honouring it.


def set_local_tensor(param: DTensor, local: torch.Tensor) -> None:
    """Make ``param`` (a DTensor, usually an ``nn.Parameter``) wrap ``local`` from now on,
    keeping the Python object (the optimizer and the module hold it). ``local`` must have the
    shape, stride and dtype the DTensor's spec already describes for this rank.

    Relies on: ``DTensor._local_tensor`` being the attribute that ``to_local()`` and every
    DTensor op read (torch's own FSDP2 re-points parameters the same way)."""
    param._local_tensor = local


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is not a slice).

    Relies on: ``DeviceMesh._get_root_mesh()``."""
    return mesh._get_root_mesh()


def run_eagerly(fn):
    """``fn`` wrapped so that ``torch.compile`` never traces it: a compiled caller breaks its
    graph there and calls ``fn`` as plain Python. Used for the unit's forward hooks, whose
    collectives, storage resizes and parameter swaps must not enter a graph.

    Relies on: ``torch.compiler.disable`` (public) making dynamo skip the function and
    everything it calls; outside compilation the wrapper only calls ``fn``."""
    return torch.compiler.disable(fn, recursive=True)
