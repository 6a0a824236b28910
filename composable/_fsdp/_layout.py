"""The shard layout of one parameter: which slice of dim ``d`` a rank owns, and the padded form.

[Note: the shard layout seam]
Everything in the fully_shard wing that sizes, copies or views a parameter's shard goes through
one ``ShardLayout`` (the flat buffers, the DTensor views, the reduce-scatter, deferred init, the
planner): a new way to shard is one class implementing the protocol below, chosen in `make_layout`.

`DimLayout` splits dim ``d`` (``Shard(d)``; any ``d`` with ``shard_placement_fn``) into ``W``
shards with ``torch.chunk`` semantics. With ``n = shape[d]``, ``pre = prod(shape[:d])`` and
``row = prod(shape[d+1:])``:

    c       = ceil(n / W)                   slices per shard ("chunk rows")
    rows_r  = clamp(n - r * c, 0, c)        slices held by rank r
    start_r = min(r * c, n)                 first global slice of rank r

(7 on 4 ranks: 2, 2, 2, 1; 5 on 4 ranks: 2, 2, 1, 0). For collectives each rank stores its shard
*padded* to ``c`` slices, a contiguous ``(pre, c, row)`` block; the all-gather gives ``[W, pre,
c, row]``, read as ``[pre, W * c, row]`` (no copy for ``d = 0``), the parameter in its first
``n`` slices. The real shard is ``block[:, :rows_r, :]``: contiguous for ``d = 0`` or an even
split, strided otherwise, as FSDP2's ([Note: flat buffers] in ``_param_group.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import Shard

from shardwise.mesh import byte_layout  # the one byte packer (re-exported for the unit's buffers)

from .._chunks import chunk_range, chunk_rows

__all__ = ["ShardLayout", "DimLayout", "make_layout", "byte_columns", "byte_layout"]


class ShardLayout(Protocol):
    """How one tensor of ``shape`` is split over ``world`` ranks of the shard axis.

    ``padded_numel``: the elements every rank stores and communicates for it (equal on all
    ranks: the all-gather and reduce-scatter take equal pieces). ``placement``: the DTensor
    placement of the data-parallel shard axis. ``shard_shape(r)``: the shape of rank ``r``'s
    real shard, and ``local_view(padded, r)`` that shard as a view of its padded segment.
    ``scatter(full, dst, lo, hi)`` writes the padded pieces of ranks ``lo..hi-1`` of ``full``
    into the ``[hi - lo, padded_numel]`` view ``dst`` (padding zeroed), ``gather(src, full)``
    is its inverse over all ranks (``src`` is ``[world, padded_numel]``)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def world(self) -> int: ...

    @property
    def padded_numel(self) -> int: ...

    @property
    def placement(self) -> Shard: ...

    def shard_shape(self, rank: int) -> tuple[int, ...]: ...

    def local_view(self, padded: torch.Tensor, rank: int) -> torch.Tensor: ...

    def scatter(self, full: torch.Tensor, dst: torch.Tensor, lo: int, hi: int) -> None: ...

    def gather(self, src: torch.Tensor, full: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DimLayout:
    """The split of dim ``dim`` of a tensor of ``shape`` over ``world`` ranks (see the module
    docstring). ``rows`` / ``row_numel`` / ``pre_numel``: ``n``, ``row`` and ``pre`` above."""

    shape: tuple[int, ...]
    world: int
    dim: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) == 0:
            raise ValueError("a 0-d tensor has no dim to shard")
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(f"shard dim {self.dim} is out of range for a tensor of shape {self.shape}")
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")

    @property
    def placement(self) -> Shard:
        return Shard(self.dim)

    @property
    def rows(self) -> int:
        return self.shape[self.dim]

    @property
    def pre_numel(self) -> int:
        return math.prod(self.shape[: self.dim])

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[self.dim + 1 :])

    @property
    def chunk_rows(self) -> int:
        """``c = ceil(n / W)``: the slices of every non-trailing shard, padding included."""
        return chunk_rows(self.rows, self.world)

    @property
    def padded_numel(self) -> int:
        return self.pre_numel * self.chunk_rows * self.row_numel

    def shard_start(self, rank: int) -> int:
        return chunk_range(self.rows, self.world, rank)[0]

    def shard_rows(self, rank: int) -> int:
        start, stop = chunk_range(self.rows, self.world, rank)
        return stop - start

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        return (*self.shape[: self.dim], self.shard_rows(rank), *self.shape[self.dim + 1 :])

    @property
    def full_ranks(self) -> int:
        """Number of leading ranks that hold a whole chunk of ``c`` slices."""
        return self.rows // self.chunk_rows if self.chunk_rows else 0

    @property
    def tail_rows(self) -> int:
        """Slices of the one partial shard (0 when the split is even)."""
        return self.rows - self.full_ranks * self.chunk_rows if self.chunk_rows else 0

    def local_view(self, padded: torch.Tensor, rank: int) -> torch.Tensor:
        real = padded[: self.padded_numel].view(self.pre_numel, self.chunk_rows, self.row_numel)[
            :, : self.shard_rows(rank)]
        if real.is_contiguous():  # dim 0, an even split, or an empty shard
            return real.view(self.shard_shape(rank))
        # (pre, rows_r, row) strided over the padding: split pre and row back, as views
        real = real.unflatten(0, self.shape[: self.dim])
        post = self.shape[self.dim + 1 :]
        return real.unflatten(-1, post) if post else real.squeeze(-1)

    def scatter(self, full: torch.Tensor, dst: torch.Tensor, lo: int, hi: int) -> None:
        c, pre, row = self.chunk_rows, self.pre_numel, self.row_numel
        if c == 0 or row == 0 or pre == 0 or hi <= lo:
            return
        d = dst.unflatten(1, (pre, c, row))  # [ranks, pre, c, row]
        f = full.reshape(pre, self.rows, row)
        q, t = self.full_ranks, self.tail_rows
        a, b = lo, min(hi, q)
        if a < b:
            d[a - lo : b - lo].copy_(f[:, a * c : b * c].unflatten(1, (b - a, c)).movedim(1, 0))
        if lo <= q < hi:
            d[q - lo, :, :t].copy_(f[:, q * c :])
            d[q - lo, :, t:].zero_()
        z = max(lo, q + 1)
        if z < hi:
            d[z - lo :].zero_()

    def gather(self, src: torch.Tensor, full: torch.Tensor) -> None:
        c, pre, row = self.chunk_rows, self.pre_numel, self.row_numel
        if c == 0 or row == 0 or pre == 0:
            return
        s = src.unflatten(1, (pre, c, row))
        f = full.view(pre, self.rows, row)
        q, t = self.full_ranks, self.tail_rows
        f[:, : q * c].unflatten(1, (q, c)).copy_(s[:q].movedim(0, 1))
        if t:
            f[:, q * c :].copy_(s[q, :, :t])


def make_layout(shape: tuple[int, ...], world: int, placement: Shard | None = None) -> DimLayout:
    """The layout for a parameter of (TP-local) ``shape``: ``placement`` is what
    ``shard_placement_fn`` returned for it (None: ``Shard(0)``)."""
    dim = 0 if placement is None else placement.dim
    if dim < 0:
        dim += len(shape)
    return DimLayout(tuple(shape), world, dim)


def byte_columns(rows: torch.Tensor, offset: int, layout: ShardLayout, dtype: torch.dtype) -> torch.Tensor:
    """One tensor's column block of a rank-major ``[W, B]`` byte matrix, viewed as ``dtype``:
    bytes ``[offset, offset + padded_numel * itemsize)`` of every row, i.e. a ``[W, padded_numel]``
    view whose row ``r`` is rank ``r``'s padded shard. See [Note: flat buffers] in
    ``_param_group.py``."""
    return rows[:, offset : offset + layout.padded_numel * dtype.itemsize].view(dtype)
