"""The one byte packer (`byte_layout`), in the package every other may import: fully_shard's unit
buffers, the whole-matrix owners' exchange, the planner and the writer process's staging buffer."""

from __future__ import annotations

__all__ = ["byte_layout"]


def byte_layout(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Offsets of consecutive segments of ``sizes`` bytes, each starting at a multiple of
    ``align`` (a multiple of every element size in the buffer, so every typed view is aligned;
    with ``align`` the one element size there are no gaps at all), and the total size."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += -(-s // align) * align
    return offsets, total
