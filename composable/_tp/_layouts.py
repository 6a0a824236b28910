"""Activation layouts on the tensor-parallel axis: local tensors <-> DTensors, with exact sizes.

A *layout* is one DTensor placement on a 1-D ``tp`` mesh of ``p`` ranks: ``Replicate()``;
``Shard(d)`` with ``torch.chunk`` semantics (``c = ceil(n / p)``, rank ``r`` holds rows
``[min(r c, n), min((r+1) c, n))``: 7 on 2 ranks is 4 + 3, 5 on 4 is 2 + 2 + 1 + 0); ``Partial()``
(the tensor is the sum over ranks).

A plain local tensor needs its *global* shape to become a DTensor; for ``Shard(d)`` one rank's
piece does not tell it when sizes are uneven. Three sources, in order (`as_dtensor`):

1. the caller knows it (a Rowwise Linear's input width is ``in_features``): the piece is checked
   against the ``torch.chunk`` layout, so uneven hidden sizes work (unlike torch's);
2. ``uneven_shards=True`` on the style: the ranks exchange lengths (`exchange_sizes`, one
   all-gather and a host read per call) and check them;
3. otherwise, as torch: equal pieces, global length ``p * local``, no communication.

A DTensor input carries its shape and needs none of these.

[Note: no size exchange by default]
Exchanging lengths on every call cost every style with a plain ``Shard`` input one collective and
a host sync per forward. torch assumes equal pieces; so do we unless told, so a plan costs what
it costs under torch. A wrong assumption gives a wrong global shape, exactly as in torch.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .._chunks import chunk_range, chunk_sizes
from .._mesh_utils import all_gather_single, same_mesh

__all__ = [
    "normalize",
    "same_layout",
    "chunk_sizes",
    "shard_range",
    "local_shard_range",
    "exchange_sizes",
    "as_dtensor",
    "to_layout",
    "to_local_share",
    "check_tp_mesh",
    "NotATensorError",
]


class NotATensorError(TypeError, ValueError):
    """A style was told to lay out something that is not a tensor (torch raises ValueError
    for ``SequenceParallel``; a ``TypeError`` in spirit)."""


def check_tp_mesh(mesh: DeviceMesh, what: str) -> None:
    """Raise unless ``mesh`` is a 1-D DeviceMesh (the tensor-parallel axis)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        hint = "mesh['tp']" if names and "tp" in names else "the 1-D tensor-parallel sub-mesh"
        raise ValueError(f"{what}: tensor parallelism runs on a 1-D mesh, got a {mesh.ndim}-D mesh "
                         f"with axes {names}; pass {hint}")


def normalize(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` of a 3-D tensor -> ``Shard(2)``; other placements unchanged."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def same_layout(a: Placement, b: Placement, ndim: int) -> bool:
    """Whether two placements describe the same layout of an ``ndim``-D tensor."""
    return normalize(a, ndim) == normalize(b, ndim)


def shard_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows of a length-``n`` dimension that ``rank`` holds under ``Shard``."""
    return chunk_range(n, parts, rank)


def local_shard_range(tensor: DTensor, dim: int) -> tuple[int, int]:
    """``[start, stop)``: the global indices of dimension ``dim`` held by this rank.

    ``tensor`` is a DTensor on a 1-D mesh; for ``Shard(dim)`` this is `shard_range`, for any
    other placement the whole ``[0, n)``. Extension forwards use it to find, for example,
    which experts or vocabulary rows are local.
    """
    mesh = tensor.device_mesh
    check_tp_mesh(mesh, "local_shard_range")
    n = tensor.shape[dim]
    if normalize(tensor.placements[0], tensor.ndim) == Shard(dim % tensor.ndim):
        return shard_range(n, mesh.size(), mesh.get_local_rank())
    return 0, n


def exchange_sizes(local: int, mesh: DeviceMesh, device: torch.device) -> list[int]:
    """Every rank's ``local`` (one all-gather of one int64 each over the mesh's group)."""
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    out = torch.empty(mesh.size(), dtype=torch.int64, device=device)
    all_gather_single(out, mine, group=mesh.get_group())
    return out.tolist()


def _global_shape(x: torch.Tensor, mesh: DeviceMesh, dim: int, global_size: int | None) -> list[int]:
    p, r = mesh.size(), mesh.get_local_rank()
    local = x.shape[dim]
    if global_size is None:
        sizes = exchange_sizes(local, mesh, x.device)
        global_size = sum(sizes)
        if sizes != chunk_sizes(global_size, p):
            raise ValueError(
                f"local pieces along dim {dim} have lengths {sizes} on the {p} tensor-parallel "
                f"ranks, but Shard({dim}) of length {global_size} holds {chunk_sizes(global_size, p)} "
                f"(torch.chunk layout); split the tensor with torch.chunk or pass a DTensor")
    elif local != chunk_sizes(global_size, p)[r]:
        raise ValueError(
            f"rank {r} holds {local} entries of dim {dim}, but Shard({dim}) of a length-"
            f"{global_size} dimension on {p} ranks holds {chunk_sizes(global_size, p)}; the "
            "input does not have the layout the plan says (check input_layouts)")
    shape = list(x.shape)
    shape[dim] = global_size
    return shape


def as_dtensor(x: torch.Tensor, mesh: DeviceMesh, placement: Placement, *,
               global_size: int | None = None, uneven: bool = False) -> DTensor:
    """View this rank's local ``x`` as a DTensor with layout ``placement`` (differentiable).

    A DTensor ``x`` is returned as is (its own layout wins, as in torch). For ``Shard(d)``:
    ``global_size`` (the global length of ``d``, when the caller knows it) is checked against
    this rank's piece; else ``uneven=True`` exchanges the ranks' lengths; else the pieces are
    taken to be equal (``p * local``, torch's assumption, no communication). No data moves.
    """
    if isinstance(x, DTensor):
        if not same_mesh(x.device_mesh, mesh):  # by value, never identity
            raise ValueError(f"input DTensor lives on {x.device_mesh}, the module on {mesh}; "
                             "redistribute it onto the tensor-parallel mesh first")
        return x
    if not isinstance(x, torch.Tensor):
        raise NotATensorError(f"expected a torch.Tensor to lay out as {placement}, got "
                              f"{type(x).__name__}; give this argument the layout None to leave it alone")
    placement = normalize(placement, x.ndim)
    if not isinstance(placement, Shard) or (global_size is None and not uneven):
        return DTensor.from_local(x, mesh, [placement], run_check=False)
    shape = _global_shape(x, mesh, placement.dim, global_size)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(x, mesh, [placement], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def to_layout(x: torch.Tensor, mesh: DeviceMesh, given: Placement | None, desired: Placement | None,
              *, global_size: int | None = None, uneven: bool = False) -> torch.Tensor:
    """``x`` (plain, laid out as ``given``, or a DTensor) as a DTensor laid out as ``desired``.

    ``given`` None leaves a plain ``x`` untouched; ``desired`` None keeps the layout;
    ``global_size`` / ``uneven`` as in `as_dtensor`. The
    collective is the one ``redistribute`` picks: Shard -> Replicate all-gather, Partial ->
    Replicate all-reduce, Partial -> Shard reduce-scatter, Replicate -> Shard none.
    """
    if given is None:
        if not isinstance(x, DTensor):
            return x
        dt = x
    else:
        dt = as_dtensor(x, mesh, given, global_size=global_size, uneven=uneven)
    if desired is not None and not same_layout(dt.placements[0], desired, dt.ndim):
        dt = dt.redistribute(mesh, [normalize(desired, dt.ndim)])
    return dt


def to_local_share(t: DTensor) -> torch.Tensor:
    """``t``'s local tensor for a computation that does this rank's share of the work.

    Same values as ``t.to_local()``; the difference is the backward: a gradient arriving for a
    replicated ``t`` is taken as this rank's summand (``Partial``) and summed over the ranks
    (one all-reduce) before it reaches ``t``. Sharded placements keep their meaning.
    """
    grads = [Partial() if isinstance(pl, Replicate) else pl for pl in t.placements]
    return t.to_local(grad_placements=grads)
