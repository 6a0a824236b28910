"""The torch private API that tensor parallelism relies on, in one place.

``tests/test_tp_compat.py`` checks exactly what is relied on here against the installed torch,
so an upgrade that changes it fails there first.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, _mesh_resources

__all__ = ["current_mesh"]


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with ``with mesh:``, or None outside any such block.

    torch's ``parallelize_module(module, parallelize_plan=...)`` takes its mesh from this
    context when none is passed. Relies on: ``DeviceMesh.__enter__`` pushing the mesh onto
    ``_mesh_resources.mesh_stack`` (a list, innermost last) and ``__exit__`` popping it.
    """
    stack = getattr(_mesh_resources, "mesh_stack", None)
    return stack[-1] if stack else None
