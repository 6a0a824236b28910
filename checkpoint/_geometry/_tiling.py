"""Exact tiling: do a tensor's saved boxes cover it with no hole and no overlap?

The format promises that the saved boxes of a tensor are pairwise disjoint, lie inside it and
together cover it. `tiling_problem` is the one check of that promise; ``save`` runs it before
the index is committed, and ``load``, ``verify``, ``merge`` and ``reshard`` run it before
reading, so that neither a wrong save nor a damaged index can fill a tensor partly from stale
memory or from two different sources.

[Note: why counting elements is not enough]
Disjoint boxes inside the tensor whose element counts add up to the tensor's cover it. But
overlapping boxes can add up to the same count while leaving a hole (two copies of the top
half and nothing of the bottom), so the pairwise disjointness check is what makes the count
meaningful. It sweeps along dim 0: boxes are sorted by their first row, and a box is compared
only with the boxes that start before it ends in dim 0. For the layouts shardwise writes (dim-0
shards, strided dim-0 runs, or a few column shards) that is close to linear.

Exact duplicates (the same box twice) are what a save before the one-writer fix wrote for
data replicated over a mesh axis the DTensor's mesh does not name; ``distinct_boxes`` keeps
the first of each so such checkpoints still load (the copies are checksummed alike).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ._boxes import Box

__all__ = ["tiling_problem", "distinct_boxes", "saved_tiling_problem"]


def distinct_boxes(boxes: Sequence[Box]) -> list[int]:
    """The positions of ``boxes`` with every exact duplicate after its first copy left out."""
    seen: set[Box] = set()
    keep = []
    for i, b in enumerate(boxes):
        if b not in seen:
            seen.add(b)
            keep.append(i)
    return keep


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None when ``boxes`` tile a tensor of ``shape`` exactly, else one sentence saying what is
    wrong: a box of the wrong rank, a box outside the shape, an empty box, two overlapping
    boxes (the word "overlapping" and both boxes), or a hole (how many elements are missing).

    Arithmetic only (no element is materialised), so a damaged shape such as ``[2**62]`` costs
    nothing. A tensor with no elements has no boxes.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    for b in boxes:
        if len(b.sizes) != len(shape):
            return f"box at {list(b.offsets)} has {len(b.sizes)} dimensions, the tensor {len(shape)}"
        if not b.within(shape):
            return f"box at {list(b.offsets)} of size {list(b.sizes)} lies outside the shape {list(shape)}"
        if b.numel == 0:
            return f"box at {list(b.offsets)} of size {list(b.sizes)} is empty (saved boxes never are)"
    if not shape:  # 0-d: at most one box, the whole element
        if len(boxes) > 1:
            return f"{len(boxes)} overlapping boxes of a 0-d tensor"
    order = sorted(boxes, key=lambda b: b.offsets)
    active: list[Box] = []  # boxes whose dim-0 range reaches past the current box's first row
    for b in order:
        if shape:
            active = [a for a in active if a.ends[0] > b.offsets[0]]
        for a in active:
            if a.intersect(b) is not None:
                return (f"overlapping boxes: at {list(a.offsets)} of size {list(a.sizes)} and at "
                        f"{list(b.offsets)} of size {list(b.sizes)}")
        active.append(b)
    have = sum(b.numel for b in boxes)
    if have != total:
        return f"the boxes hold {have} of the tensor's {total} elements (a hole of {total - have})"
    return None


def saved_tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """`tiling_problem` of a tensor's saved ``boxes`` with exact duplicates left out
    (`distinct_boxes`): what ``load``, ``verify`` and ``inspect`` check of an index."""
    return tiling_problem(shape, [boxes[i] for i in distinct_boxes(boxes)])
