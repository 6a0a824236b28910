"""Index arithmetic of dim-0 sharding: which rows a rank owns, and the padded layout.

A parameter of global shape ``(n, *rest)`` is split along dim 0 into ``W`` shards with
``torch.chunk`` semantics (this is also how ``Shard(0)`` lays out a DTensor whose size does
not divide the mesh axis):

    c      = ceil(n / W)                    rows per shard ("chunk rows")
    rows_r = clamp(n - r * c, 0, c)         rows held by rank r
    start_r = min(r * c, n)                 first global row of rank r

so the leading ranks hold ``c`` rows, at most one rank holds a partial chunk and trailing
ranks may hold nothing (7 rows on 4 ranks: 2, 2, 2, 1; 5 rows on 4 ranks: 2, 2, 1, 0;
2 rows on 4 ranks: 1, 1, 0, 0).

For collectives every rank stores its shard *padded* to ``c`` rows, so the all-gather of
``W`` equal pieces lays the rows out as ``W * c >= n`` padded rows whose first ``n`` are
the parameter. See [Note: flat buffers] in ``_param_group.py`` for how several parameters
share one buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._chunks import chunk_range, chunk_rows, chunk_sizes

__all__ = ["DimZeroLayout", "byte_columns", "scatter_rows", "gather_rows"]


def byte_columns(rows, offset: int, layout: "DimZeroLayout", dtype):
    """One tensor's column block of a rank-major ``[W, B]`` byte matrix, viewed as ``dtype``:
    bytes ``[offset, offset + padded_numel * itemsize)`` of every row, i.e. a ``[W, padded_numel]``
    view whose row ``r`` is rank ``r``'s padded shard. See [Note: flat buffers] in
    ``_param_group.py``."""
    return rows[:, offset : offset + layout.padded_numel * dtype.itemsize].view(dtype)


@dataclass(frozen=True)
class DimZeroLayout:
    """The dim-0 split of one tensor of ``shape`` over ``world`` ranks.

    ``row_numel`` is the number of elements in one row (``prod(shape[1:])``);
    ``padded_numel`` is what every rank stores and communicates for this tensor.
    """

    shape: tuple[int, ...]
    world: int

    def __post_init__(self) -> None:
        if len(self.shape) == 0:
            raise ValueError("a 0-d tensor has no dim 0 to shard")
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk_rows(self) -> int:
        """``c = ceil(n / W)``: the rows of every non-trailing shard, padding included."""
        return chunk_rows(self.rows, self.world)

    @property
    def padded_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def shard_start(self, rank: int) -> int:
        return chunk_range(self.rows, self.world, rank)[0]

    def shard_rows(self, rank: int) -> int:
        start, stop = chunk_range(self.rows, self.world, rank)
        return stop - start

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        return (self.shard_rows(rank), *self.shape[1:])

    @property
    def full_ranks(self) -> int:
        """Number of leading ranks that hold a whole chunk of ``c`` rows."""
        return self.rows // self.chunk_rows if self.chunk_rows else 0

    @property
    def tail_rows(self) -> int:
        """Rows of the one partial shard (0 when the split is even)."""
        return self.rows - self.full_ranks * self.chunk_rows if self.chunk_rows else 0


def scatter_rows(layout: DimZeroLayout, full, dst, lo: int, hi: int) -> None:
    """Write the padded shards of ranks ``lo .. hi-1`` of ``full`` into ``dst``.

    ``full`` has ``layout.shape``; ``dst`` is a ``[hi - lo, padded_numel]`` view (rows may be
    strided, as when ``dst`` is one parameter's columns of a rank-major flat buffer). Padding
    rows are zeroed so that a sum over ranks never picks up stale memory.
    """
    c, row = layout.chunk_rows, layout.row_numel
    if c == 0 or row == 0 or hi <= lo:
        return
    d = dst.unflatten(1, (c, row))
    f = full.reshape(layout.rows, row)
    q, t = layout.full_ranks, layout.tail_rows
    a, b = lo, min(hi, q)
    if a < b:
        d[a - lo : b - lo].copy_(f[a * c : b * c].view(b - a, c, row))
    if lo <= q < hi:
        d[q - lo, :t].copy_(f[q * c :])
        d[q - lo, t:].zero_()
    z = max(lo, q + 1)
    if z < hi:
        d[z - lo :].zero_()


def gather_rows(layout: DimZeroLayout, src, full) -> None:
    """Inverse of :func:`scatter_rows` over all ranks: ``src`` is ``[world, padded_numel]``
    (the all-gathered pieces, rank-major), ``full`` a contiguous tensor of ``layout.shape``."""
    c, row = layout.chunk_rows, layout.row_numel
    if c == 0 or row == 0:
        return
    s = src.unflatten(1, (c, row))
    f = full.view(layout.rows, row)
    q, t = layout.full_ranks, layout.tail_rows
    f[: q * c].view(q, c, row).copy_(s[:q])
    if t:
        f[q * c :].copy_(s[q, :t])
