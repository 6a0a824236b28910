"""The torch private DeviceMesh API the mesh package needs, in one place (the house rule: each
use fenced here, each with a test in tests/test_cp_mesh.py).

``flatten_axes(sub, name)``: one 1-D axis over the ranks of a multi-axis sub-mesh, registered
on the root mesh so that the root can be sliced by the new name, alone or with its other axes
(``root[("dp_shard_cp", "tp")]``). Relies on ``DeviceMesh._flatten(name)`` (row-major order
of the sub-mesh's ranks; calling it again with the same name returns the same axis) and on the
root mesh accepting the flattened name in a slice (torch 2.13 warns that slicing a flattened
dim from the root "will be deprecated"; it still works, and tests/test_cp_mesh.py fails first
when it stops).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_axes"]


def flatten_axes(sub: DeviceMesh, name: str) -> DeviceMesh:
    """``sub``'s ranks as one axis called ``name`` (collective on first use: new groups)."""
    return sub._flatten(name)
