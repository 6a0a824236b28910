"""The torch private APIs that ``shardwise.composable`` relies on, in one place.

Each helper names what it uses; ``tests/test_dropin_compat.py`` checks that the behaviour we
rely on still holds for the installed torch, so an upgrade that changes it fails there first.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.autograd import Variable
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "set_local_tensor",
    "root_mesh",
    "concatenate_meshes",
    "flatten_mesh",
    "run_eagerly",
    "strided_shard",
    "is_strided_shard",
    "queue_backward_callback",
    "backward_running",
    "storage_key",
    "storage_shared",
    "foreach_norm",
    "foreach_mul_",
    "TorchDispatchMode",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
]

# ``TorchDispatchMode`` (``torch.utils._python_dispatch``): a context manager whose
# ``__torch_dispatch__`` sees every aten op run under it; ``materialize`` uses it to see which
# placeholder storage the user's init code touches. Relied on: subclassing it, entering it with
# ``with``, and ``func(*args, **kwargs)`` running the op.
#
# ``tree_flatten`` / ``tree_unflatten`` / ``tree_map`` (``torch.utils._pytree``): flattening the
# nested args / kwargs / outputs of a forward to find their tensors. Relied on: flatten returning
# ``(leaves, spec)`` with tensors as leaves, unflatten rebuilding the same structure.


def strided_shard(dim: int, split_factor: int):
    """The placement of a mesh axis that shards ``dim`` *within* each of ``split_factor``
    chunks made by a later axis (FSDP over a tensor-parallel dim 0).

    Relies on: ``_StridedShard(dim, split_factor=s)``, and ``full_tensor()`` / redistribute
    honouring it."""
    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is a strided shard (see :func:`strided_shard`).

    Relies on: strided placements being instances of ``_StridedShard``."""
    return isinstance(placement, _StridedShard)


def queue_backward_callback(fn) -> None:
    """Run ``fn()`` once the current ``backward()`` has finished (call it during backward).

    Relies on: ``Variable._execution_engine.queue_callback`` (torch's FSDP2 ends its backward the
    same way)."""
    Variable._execution_engine.queue_callback(fn)


def backward_running() -> bool:
    """Whether the calling thread is running an autograd backward now (inside a hook, an
    autograd Function's backward, a recomputation of activation checkpointing, a queued
    callback). torch offers no public signal for this.

    Relies on: ``torch._C._current_graph_task_id()`` returning ``-1`` on a thread that runs no
    graph task, and another value while one runs (torch's FSDP2 and module tracker ask the
    same way)."""
    return torch._C._current_graph_task_id() != -1


def storage_key(t: torch.Tensor) -> int:
    """An int naming the storage ``t`` views: equal for every view of one storage, different
    for distinct live storages, stable while the storage is resized (to 0 and back).

    Relies on: ``UntypedStorage._cdata`` (the address of the C++ storage object). The public
    ``data_ptr()`` is not enough: every storage resized to 0 bytes has data pointer 0."""
    return t.untyped_storage()._cdata


def storage_shared(t: torch.Tensor) -> bool:
    """Whether another live tensor (a view, a gradient the user kept) uses ``t``'s storage.

    Relies on: ``torch._C._storage_Use_Count`` (the reference count of the C++ storage: one
    per tensor viewing it, plus one for the temporary ``UntypedStorage`` made to ask)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


def foreach_norm(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """Per-tensor ``p``-norms of same-device, same-dtype tensors, fused.

    Relies on: ``torch._foreach_norm``. The public ``torch.nn.utils.get_total_norm`` returns
    only the norm of all tensors together; ``clip_grad_norm_`` needs one per tensor to reduce
    each over its own mesh axes."""
    return list(torch._foreach_norm(tensors, p))


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """``t.mul_(scalar)`` for every tensor (same device and dtype), fused.

    Relies on: ``torch._foreach_mul_`` with a 0-d tensor scalar."""
    torch._foreach_mul_(tensors, scalar)


def set_local_tensor(param: DTensor, local: torch.Tensor) -> None:
    """Make ``param`` (a DTensor, usually an ``nn.Parameter``) wrap ``local`` from now on,
    keeping the Python object (the optimizer and the module hold it). ``local`` must have the
    shape, stride and dtype the DTensor's spec already describes for this rank.

    Relies on: ``DTensor._local_tensor`` being the attribute that ``to_local()`` and every
    DTensor op read (torch's own FSDP2 re-points parameters the same way)."""
    param._local_tensor = local


def local_tensor(param: DTensor) -> torch.Tensor:
    """The very tensor object ``param`` (a DTensor, usually an ``nn.Parameter``) wraps, so that
    attributes set on it (torchao's ``_precomputed_scale``) are seen. ``to_local()`` of an
    ``nn.Parameter(DTensor)`` returns a new parameter object over the same data (a tensor
    subclass's ``detach``, which need not copy such attributes).

    Relies on: ``DTensor._local_tensor`` being that object (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` writes to it under FSDP2)."""
    return param._local_tensor


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is not a slice).

    Relies on: ``DeviceMesh._get_root_mesh()``."""
    return mesh._get_root_mesh()


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes`` in order (their names and process groups),
    for meshes sliced from one mesh however it was built: named slices of one ``init_device_mesh``,
    or slices of one ``DeviceMesh._unflatten`` of a 1-D world mesh (torchtitan's), whose root
    has none of their names. ``RuntimeError`` if they come from different meshes or overlap.

    Relies on: ``DeviceMesh._concatenate`` (torch's FSDP2 builds its ``(dp..., tp)`` mesh with
    it), comparing the meshes' rank maps by value."""
    return DeviceMesh._concatenate(list(meshes))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s ranks (row-major) as one 1-D axis called ``name``, with its own process group
    (collective over every rank on first use; the same axis again for the same name).

    Relies on: ``DeviceMesh._flatten(name)`` (torch's FSDP2 flattens ``dp_mesh_dims`` tuples
    with it, named ``"_".join(names)``)."""
    return mesh._flatten(name)


def run_eagerly(fn):
    """``fn`` wrapped so that ``torch.compile`` never traces it: a compiled caller breaks its
    graph there and calls ``fn`` as plain Python. Used for the unit's forward hooks, whose
    collectives, storage resizes and parameter swaps must not enter a graph.

    Relies on: ``torch.compiler.disable`` (public) making dynamo skip the function and
    everything it calls; outside compilation the wrapper only calls ``fn``."""
    return torch.compiler.disable(fn, recursive=True)


def traced_collective(kind: str, t: torch.Tensor, group) -> torch.Tensor:
    """One collective over ``group`` that ``torch.compile`` traces into its graph (the traced
    unit, [Note: the traced unit] in ``_fsdp/_traced.py``): ``"all_gather"`` (rank-major
    along dim 0), ``"reduce_scatter"`` (sum, dim 0) or ``"all_reduce"`` (sum). Outside a trace
    it runs eagerly and returns the finished result.

    Relies on: ``torch.distributed._functional_collectives`` (``all_gather_tensor``,
    ``reduce_scatter_tensor``, ``all_reduce``, each taking a process group)."""
    import torch.distributed._functional_collectives as fc

    if kind == "all_gather":
        out = fc.all_gather_tensor(t, 0, group)
    elif kind == "reduce_scatter":
        out = fc.reduce_scatter_tensor(t, "sum", 0, group)
    else:
        out = fc.all_reduce(t, "sum", group)
    return out.wait() if isinstance(out, fc.AsyncCollectiveTensor) else out
