"""Planning reads: which slices of which saved boxes fill a destination, in bounded pieces.

A destination (`LocalBox`) is filled from the saved boxes of its tensor; these are disjoint, so
it is covered exactly when its intersections' element counts add up to its own. Each
intersection is one `ReadItem`: a region of one saved box (a safetensors slice) and the local
region it fills. `split` bounds memory by cutting an item into pieces of at most ``max_numel``
elements along its outermost dimension with more than one index (going one dimension deeper
when one index is too large); each piece is read, copied and dropped before the next.
`partition_problem` is ``_tiling.tiling_problem``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._boxes import Box, LocalBox
from ._tiling import tiling_problem

__all__ = ["ReadItem", "plan_reads", "covered_numel", "split", "partition_problem"]


@dataclass(frozen=True)
class ReadItem:
    """Fill ``dst`` (a region of the local tensor) from ``src`` (a region of saved box ``source``)."""

    source: int
    src: Box
    dst: Box


def plan_reads(dest: LocalBox, saved: Sequence[Box]) -> list[ReadItem]:
    """One item per saved box that meets ``dest.box``, in the order of ``saved``."""
    items = []
    for i, s in enumerate(saved):
        common = dest.box.intersect(s)
        if common is None:
            continue
        items.append(ReadItem(i, common.shifted(s.offsets), common.shifted(dest.box.offsets, dest.local_offsets)))
    return items


def covered_numel(items: Sequence[ReadItem]) -> int:
    return sum(it.src.numel for it in items)


def _split_box_pairs(src: Box, dst: Box, max_numel: int) -> list[tuple[Box, Box]]:
    if src.numel <= max_numel:
        return [(src, dst)]
    d = next(i for i, n in enumerate(src.sizes) if n > 1)
    inner = src.numel // src.sizes[d]
    step = max(1, max_numel // inner)
    out = []
    for start in range(0, src.sizes[d], step):
        n = min(step, src.sizes[d] - start)
        s = _narrow(src, d, start, n)
        t = _narrow(dst, d, start, n)
        out.extend(_split_box_pairs(s, t, max_numel) if n == 1 and inner > max_numel else [(s, t)])
    return out


def _narrow(b: Box, d: int, start: int, n: int) -> Box:
    offsets = list(b.offsets)
    sizes = list(b.sizes)
    offsets[d] += start
    sizes[d] = n
    return Box(tuple(offsets), tuple(sizes))


def split(item: ReadItem, max_numel: int) -> list[ReadItem]:
    """``item`` cut into items of at most ``max(max_numel, 1)`` elements, in row-major order."""
    return [ReadItem(item.source, s, d) for s, d in _split_box_pairs(item.src, item.dst, max(1, max_numel))]


def partition_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` tile a tensor of ``shape`` exactly, else what is wrong (``_tiling.tiling_problem``)."""
    return tiling_problem(shape, boxes)
