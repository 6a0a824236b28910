"""How one sharded tensor's whole value splits over the ranks that must meet to rebuild it.

[Note: the gather group of a whole tensor]
The ranks that together hold a DTensor's whole value differ only on its sharding axes (not its
``Replicate`` ones): the *gather group*. One sharding axis is that axis's process group; several
(FSDP x TP) are flattened into one (row-major) so one all-to-all reaches them. Replica axes are
left alone: each replica's group rebuilds and updates the same value, as HSDP replicas reduce the
same gradient. A rank's piece is one box: the plain shards cut in axis order, then the strided
ones ([Note: sharding a tensor-parallel parameter] in ``composable/_fsdp/_tp_param.py``), with
the checkpoint's arithmetic (``boxes_for``: [Note: boxes of a placement] in
``checkpoint/_geometry/_boxes.py``). A plain tensor, or one with no sharding axis, is a group of one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.checkpoint import boxes_for

from .._compat import flatten_mesh, is_strided_shard

__all__ = ["Pieces", "pieces_of"]

Box = tuple[tuple[int, int], ...]  # per dim: [start, stop)


@dataclass(frozen=True)
class Pieces:
    """A tensor of ``shape`` cut over a gather group of ``world`` ranks: ``boxes[r]`` is the
    piece group rank ``r`` holds (this rank is ``rank``), ``group`` the process group (None for a
    group of one), ``key`` what tensors sharing one all-to-all have in common."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    rank: int
    group: dist.ProcessGroup | None
    key: tuple

    @property
    def world(self) -> int:
        return len(self.boxes)

    def piece(self, full: torch.Tensor, r: int) -> torch.Tensor:
        """Group rank ``r``'s piece of the whole ``full`` (a view)."""
        return full[tuple(slice(a, b) for a, b in self.boxes[r])]

    def piece_shape(self, r: int) -> torch.Size:
        return torch.Size(b - a for a, b in self.boxes[r])

    def assemble(self, pieces: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out`` (the whole shape) filled from every rank's piece, in group rank order."""
        for r, t in enumerate(pieces):
            if t.numel():
                self.piece(out, r).copy_(t.view(self.piece_shape(r)))
        return out


def _box(shape: tuple[int, ...], sizes: list[int], coord: tuple[int, ...], placements: list, where: str) -> Box:
    """The one box the rank at ``coord`` of the sharding axes holds (empty: ``(0, 0)`` per dim)."""
    boxes = boxes_for(shape, sizes, coord, placements)
    if len(boxes) > 1:
        raise ValueError(f"{where}: placements {tuple(placements)} give rank {coord} several pieces, not one box; "
                         "whole-tensor steps need each rank's shard to be one box")
    if not boxes:
        return tuple((0, 0) for _ in shape)
    b = boxes[0].box
    return tuple((o, o + n) for o, n in zip(b.offsets, b.sizes))


def _gather_mesh(mesh: DeviceMesh, dims: list[int], where: str) -> DeviceMesh:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{where}: the parameter is sharded over mesh axes {dims} of an unnamed mesh; whole-tensor "
                         "steps over several sharding axes need named axes (init_mesh / init_device_mesh "
                         "mesh_dim_names=...)")
    picked = tuple(names[d] for d in dims)
    sub = mesh[picked]
    return flatten_mesh(sub, "_".join(picked))


def pieces_of(p: torch.Tensor, where: str) -> Pieces:
    """The gather group of ``p`` and every member's piece ([Note: the gather group of a whole
    tensor]); a one-line ``ValueError`` naming ``where`` for a placement it cannot rebuild."""
    shape = tuple(p.shape)
    whole: Box = tuple((0, n) for n in shape)
    if not isinstance(p, DTensor):
        return Pieces(shape, (whole,), 0, None, ("local",))
    mesh, placements = p.device_mesh, tuple(p.placements)
    dims = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
    bad = [pl for i, pl in enumerate(placements) if i in dims and not (isinstance(pl, Shard) or is_strided_shard(pl))]
    if bad:
        raise ValueError(f"{where}: a parameter with placement {bad[0]} (placements {placements}) cannot be "
                         "rebuilt whole; whole-tensor steps take parameters sharded (Shard / strided Shard) or "
                         "replicated on each mesh axis")
    if not dims or all(mesh.size(d) == 1 for d in dims):
        return Pieces(shape, (whole,), 0, None, ("local",))
    if len(dims) == 1:
        group, rank = mesh.get_group(dims[0]), mesh.get_local_rank(dims[0])
    else:
        flat = _gather_mesh(mesh, dims, where)
        group, rank = flat.get_group(0), flat.get_local_rank(0)
    sizes = [mesh.size(d) for d in dims]
    boxes = tuple(_box(shape, sizes, coord, [placements[d] for d in dims], where)
                  for coord in itertools.product(*(range(n) for n in sizes)))
    mine = tuple(p.to_local().shape)
    held = tuple(b - a for a, b in boxes[rank])
    if held != mine and (0 not in held or 0 not in mine):  # an empty piece is empty in any shape
        raise ValueError(f"{where}: the local shard's shape {list(mine)} is not the torch.chunk piece "
                         f"{[b - a for a, b in boxes[rank]]} its placements {placements} give; whole-tensor "
                         "steps need torch.chunk shards (fully_shard's, DTensor's)")
    if 0 in held:  # this rank's empty piece in its local tensor's shape (what it sends and receives)
        boxes = boxes[:rank] + (tuple((0, n) for n in mine),) + boxes[rank + 1:]
    return Pieces(shape, boxes, rank, group, ("group", tuple(dist.get_process_group_ranks(group))))
