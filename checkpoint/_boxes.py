"""Boxes: which part of a global tensor a rank holds, as rectangular pieces.

A *box* is a rectangular region of a tensor given in global coordinates: ``offsets`` and
``sizes``, one entry per dimension (a 0-d tensor has the single box ``offsets=() sizes=()``
of one element). A checkpoint stores every tensor as a set of disjoint boxes that together
cover it, and a rank's local shard is described as a list of `LocalBox`: a global box and
where that box starts inside the rank's local tensor.

[Note: boxes of a placement]
For placements made only of ``Shard`` and ``Replicate`` a rank's shard is one box, which
``compute_local_shape_and_global_offset`` gives. Other placements (``_StridedShard``, which
FSDP over a tensor-parallel shard produces) give a rank a set of rows that is not contiguous,
so its shard is several boxes. In general we follow, per tensor dimension, the sorted list of
global indices that the rank holds: it starts as every index, and each mesh axis's placement
narrows the list of the dimension it shards (`_RULES`, one function per placement type; a new
placement adds an entry there). A shard is then the product over dimensions of the maximal
runs of consecutive indices, each run a box; runs keep their position in the local tensor.

Which rank writes a box is decided over the whole world, not from the DTensor's own mesh:
see [Note: one writer per box over the world] in ``_owners.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard, _StridedShardOffsetMode

from ._errors import CheckpointError

__all__ = ["Box", "LocalBox", "boxes_for", "local_boxes", "layout_of"]


@dataclass(frozen=True)
class Box:
    """A rectangle of a tensor: ``offsets[d] <= index[d] < offsets[d] + sizes[d]`` for every d."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in length")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} must be >= 0")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when it has no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def shifted(self, origin: Sequence[int], to: Sequence[int] | None = None) -> Box:
        """This box with ``origin`` moved to ``to`` (default: the zero point)."""
        to = to if to is not None else (0,) * len(origin)
        return Box(tuple(o - a + b for o, a, b in zip(self.offsets, origin, to)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.sizes) and all(e <= n for e, n in zip(self.ends, shape))


@dataclass(frozen=True)
class LocalBox:
    """A box of a global tensor (``box``) and the offsets where it starts in the local tensor."""

    box: Box
    local_offsets: tuple[int, ...]

    def local_region(self) -> Box:
        return Box(self.local_offsets, self.box.sizes)


# -- per-dimension index sets (see [Note: boxes of a placement]) ----------------------------------

Indices = list[int]


def _shard_rule(p: Shard, held: Indices, axis_size: int, coord: int) -> Indices:
    size, start = Shard.local_shard_size_and_offset(len(held), axis_size, coord)
    return held[start : start + size]


def _strided_rule(p: _StridedShard, held: Indices, axis_size: int, coord: int) -> Indices:
    _, positions = p._local_shard_size_and_offset(len(held), axis_size, coord, _StridedShardOffsetMode.ALL)
    return [held[i] for i in (positions or [])]


def _replicate_rule(p: Replicate, held: Indices, axis_size: int, coord: int) -> Indices:
    return held


# Placement type -> how it narrows the indices of the dimension it shards. _StridedShard is
# checked before Shard; a placement type missing here cannot be saved (e.g. Partial: reduce it).
_RULES: tuple[tuple[type, Callable[..., Indices]], ...] = (
    (_StridedShard, _strided_rule),
    (Shard, _shard_rule),
    (Replicate, _replicate_rule),
)


def _rule(p: Placement) -> Callable[..., Indices]:
    for kind, rule in _RULES:
        if isinstance(p, kind):
            return rule
    raise CheckpointError(
        f"placement {p!r} cannot be saved or loaded: only Shard, Replicate and _StridedShard are supported. "
        "Redistribute the DTensor first (e.g. a Partial one to Replicate())"
    )


def _runs(held: Indices) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: ``(global_start, local_start, length)``."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(held):
        if runs and runs[-1][0] + runs[-1][2] == g:
            start, lstart, n = runs[-1]
            runs[-1] = (start, lstart, n + 1)
        else:
            runs.append((g, local, 1))
    return runs


def boxes_for(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[Placement]) -> list[LocalBox]:
    """The non-empty boxes held at mesh coordinate ``coord`` (any placements of `_RULES`)."""
    held: list[Indices] = [list(range(n)) for n in shape]
    for axis, p in enumerate(placements):
        rule = _rule(p)
        if isinstance(p, Shard) or isinstance(p, _StridedShard):
            held[p.dim] = rule(p, held[p.dim], mesh_shape[axis], coord[axis])
    if any(len(h) == 0 for h in held):
        return []
    per_dim = [_runs(h) for h in held]
    out = []
    for combo in itertools.product(*per_dim):
        box = Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo))
        out.append(LocalBox(box, tuple(r[1] for r in combo)))
    return out


def local_boxes(t: torch.Tensor) -> list[LocalBox]:
    """The non-empty boxes of the global tensor that this rank's ``t`` holds.

    A plain tensor is one box covering all of it (empty tensors: none).
    """
    if not isinstance(t, DTensor):
        return [LocalBox(Box((0,) * t.dim(), tuple(t.shape)), (0,) * t.dim())] if t.numel() else []
    mesh, placements = t.device_mesh, tuple(t.placements)
    coord = mesh.get_coordinate()
    if coord is None:
        return []  # this rank is not part of the tensor's mesh
    for p in placements:
        _rule(p)  # refuse unsupported placements with a clear message
    if all(type(p) in (Shard, Replicate) for p in placements):
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        if math.prod(shape) == 0:
            return []
        return [LocalBox(Box(tuple(offset), tuple(shape)), (0,) * len(shape))]
    return boxes_for(tuple(t.shape), tuple(mesh.shape), coord, placements)


def layout_of(t: torch.Tensor) -> dict | None:
    """How ``t`` was laid out when saved (informational; loading never needs it)."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [repr(p) for p in t.placements],
    }
