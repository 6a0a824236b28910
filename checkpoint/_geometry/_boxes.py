"""Boxes: which part of a global tensor a rank holds, as rectangular pieces.

A *box* is a rectangular region of a tensor in global coordinates: ``offsets`` and ``sizes``, one
entry per dimension (a 0-d tensor has the single box ``offsets=() sizes=()``). A checkpoint
stores every tensor as disjoint boxes covering it; a rank's local shard is a list of `LocalBox`:
a global box and where it starts inside the local tensor.

[Note: boxes of a placement]
Every split is ``torch.chunk``'s, as DTensor's (`chunk_span`). With only ``Shard`` and
``Replicate`` a rank's shard is one box: each mesh axis, left to right, cuts the current range of
the dimension it shards and keeps piece ``coord[axis]``. A strided shard of ``split_factor=k``
(FSDP over a tensor-parallel shard) cuts the held indices into ``k`` pieces, each into
``axis_size``, and keeps piece ``coord`` of each (`strided_positions`): several boxes. In
general we follow, per dimension, the sorted global indices the rank holds, narrowed by each mesh
axis's placement (`_RULES`, one function per placement type); the shard is the product over
dimensions of the maximal runs of consecutive indices, each run a box at its local position.

Which rank writes a box is decided over the whole world: [Note: one writer per box over the
world] in ``_owners.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .._base import CheckpointError, is_strided_shard, strided_split_factor

__all__ = ["Box", "LocalBox", "boxes_for", "chunk_span", "local_boxes", "layout_of", "strided_positions"]


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


def chunk_span(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, size)`` of piece ``i`` of ``n`` indices cut into ``parts`` pieces as
    ``torch.chunk`` cuts them: ``c = ceil(n / parts)``, piece ``i`` is ``[min(i c, n),
    min((i + 1) c, n))`` (trailing pieces may be empty)."""
    c = -(-n // parts)
    start = min(i * c, n)
    return start, min(start + c, n) - start


def strided_positions(n: int, split_factor: int, axis_size: int, coord: int) -> list[int]:
    """The positions (among ``n`` held indices) that ``coord`` holds under a strided shard
    of ``split_factor`` on a mesh axis of ``axis_size``: the ``n`` indices cut into
    ``split_factor`` pieces, each of those into ``axis_size``, piece ``coord`` of each, in order."""
    out: list[int] = []
    for j in range(split_factor):
        start, size = chunk_span(n, split_factor, j)
        sub, sub_size = chunk_span(size, axis_size, coord)
        out.extend(range(start + sub, start + sub + sub_size))
    return out


def _shard_rule(p: Shard, held: Indices, axis_size: int, coord: int) -> Indices:
    start, size = chunk_span(len(held), axis_size, coord)
    return held[start : start + size]


def _strided_rule(p: Placement, held: Indices, axis_size: int, coord: int) -> Indices:
    return [held[i] for i in strided_positions(len(held), strided_split_factor(p), axis_size, coord)]


def _replicate_rule(p: Replicate, held: Indices, axis_size: int, coord: int) -> Indices:
    return held


def _is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


def _is_replicate(p: Placement) -> bool:
    return isinstance(p, Replicate)


# Which placements -> how it narrows the indices of the dimension it shards. The strided shard is
# checked first; a placement missing here cannot be saved (e.g. Partial: reduce it).
_RULES: tuple[tuple[Callable[[Placement], bool], Callable[..., Indices]], ...] = (
    (is_strided_shard, _strided_rule),
    (_is_shard, _shard_rule),
    (_is_replicate, _replicate_rule),
)


def _rule(p: Placement) -> Callable[..., Indices]:
    for matches, rule in _RULES:
        if matches(p):
            return rule
    raise CheckpointError(
        f"placement {p!r} cannot be saved or loaded: only Shard, Replicate and the strided shard of FSDP x TP are supported. "
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
        if is_strided_shard(p) or isinstance(p, Shard):
            dim = p.dim  # type: ignore[attr-defined]  # both kinds of shard placement have one
            held[dim] = rule(p, held[dim], mesh_shape[axis], coord[axis])
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
        return _contiguous_box(tuple(t.shape), tuple(mesh.shape), coord, placements)
    return boxes_for(tuple(t.shape), tuple(mesh.shape), coord, placements)


def _contiguous_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                    placements: Sequence[Placement]) -> list[LocalBox]:
    """`boxes_for` of ``Shard``/``Replicate`` placements, without index lists: one box or none."""
    offsets, sizes = [0] * len(shape), list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            start, sizes[p.dim] = chunk_span(sizes[p.dim], mesh_shape[axis], coord[axis])
            offsets[p.dim] += start
    if math.prod(sizes) == 0:
        return []
    return [LocalBox(Box(tuple(offsets), tuple(sizes)), (0,) * len(sizes))]


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
