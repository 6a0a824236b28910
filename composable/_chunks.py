"""``torch.chunk`` split arithmetic, shared by every wing that splits a dimension over ranks
(fully_shard's layouts, tensor parallelism's uneven shards, the planner)."""

from __future__ import annotations

__all__ = ["chunk_rows", "chunk_range", "chunk_sizes"]


def chunk_rows(n: int, parts: int) -> int:
    """``c = ceil(n / parts)``: the length of every non-trailing ``torch.chunk`` piece."""
    return -(-n // parts)


def chunk_range(n: int, parts: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``rank`` when ``n`` rows are split into ``parts`` with
    ``torch.chunk`` semantics (empty, at ``n``, for trailing ranks past the end)."""
    c = chunk_rows(n, parts)
    return min(rank * c, n), min((rank + 1) * c, n)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Lengths of ``torch.chunk(range(n), parts)`` padded with zeros to ``parts`` entries."""
    return [stop - start for start, stop in (chunk_range(n, parts, r) for r in range(parts))]
