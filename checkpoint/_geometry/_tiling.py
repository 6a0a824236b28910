"""Exact tiling: do a tensor's saved boxes cover it with no hole and no overlap?

The format promises that a tensor's saved boxes are pairwise disjoint, lie inside it and cover
it. `tiling_problem` is the one check of that promise: ``save`` runs it before the commit, and
``load``, ``verify``, ``merge`` and ``reshard`` before reading, so neither a wrong save nor a
damaged index can fill a tensor partly from stale memory or from two sources.

[Note: why counting elements is not enough]
Overlapping boxes can add up to the tensor's element count while leaving a hole (two copies of
the top half, nothing of the bottom): the count means something only for disjoint boxes.

[Note: tiling in linear time]
Large jobs save 100k boxes and more (a ``[1, N]`` tensor as N boxes), where pairwise comparison
takes hours. So: dimensions in which every box spans the whole tensor are dropped, leaving ``k``
varying ones; then *corner counting*, exact and ``O(n 2^k)``: a box ``[a, b)``'s indicator is the
signed sum of its ``2^k`` corners, ``prod_d (H(x_d - a_d) - H(x_d - b_d))``, and these corner
functions are linearly independent, so the boxes cover every element exactly once iff their
signed corners, summed in a dict, equal the tensor's own. Only on failure is the problem
located, by a sweep: for ``k = 1`` sorted neighbours are compared; for ``k = 2`` the boxes open
at the sweep position are kept sorted in the other dimension (``O(n log n)``); for ``k >= 3``
(rare) a box is compared with every open one along the dimension with most distinct offsets.

[Note: tiling checked across ranks]
When no rank holds the world's boxes ([Note: writers without a gather] in ``_owners.py``),
`corner_digest` maps each signed corner to two hashed residues modulo ``2**31 - 1`` and sums
them: a linear function of the corner counts, so the ranks' digests summed by one all-reduce
equal the tensor's own when the boxes tile it, and differ otherwise except with a chance of
about ``2**-62`` per tensor. A mismatch sends the save to rank 0's exact check, which words it.

Exact duplicates (the same box twice), written by saves before the one-writer fix, are dropped
by ``distinct_boxes`` (keeping the first) so such checkpoints still load.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

from ._boxes import Box

__all__ = ["CORNER_PRIME", "corner_digest", "tiling_problem", "distinct_boxes", "saved_tiling_problem"]

CORNER_PRIME = (1 << 31) - 1  # residues below it sum over 2**32 ranks within an int64


def corner_digest(boxes: Sequence[Box]) -> tuple[int, int]:
    """Two residues modulo `CORNER_PRIME` of the signed corners of ``boxes`` ([Note: tiling
    checked across ranks]): additive, so the digests of a partition of the boxes sum (modulo
    the prime) to the digest of all of them."""
    a = b = 0
    for box in boxes:
        ends = [(o, o + n) for o, n in zip(box.offsets, box.sizes)]
        for picks in itertools.product((0, 1), repeat=len(ends)):
            corner = ",".join(str(e[p]) for e, p in zip(ends, picks))
            h = hashlib.blake2b(corner.encode(), digest_size=8).digest()
            sign = -1 if sum(picks) % 2 else 1
            a += sign * int.from_bytes(h[:4], "little")
            b += sign * int.from_bytes(h[4:], "little")
    return a % CORNER_PRIME, b % CORNER_PRIME


def distinct_boxes(boxes: Sequence[Box]) -> list[int]:
    """The positions of ``boxes`` with every exact duplicate after its first copy left out."""
    seen: set[Box] = set()
    keep = []
    for i, b in enumerate(boxes):
        if b not in seen:
            seen.add(b)
            keep.append(i)
    return keep


def _overlap_msg(a: Box, b: Box) -> str:
    return (f"overlapping boxes: at {list(a.offsets)} of size {list(a.sizes)} and at "
            f"{list(b.offsets)} of size {list(b.sizes)}")


def _corners_match(shape: tuple[int, ...], boxes: Sequence[Box], dims: list[int]) -> bool:
    """Step 2 of [Note: tiling in linear time] over the varying dimensions ``dims``."""
    if len(dims) == 1:  # the common cases, unrolled (the generic loop below is 5x slower)
        d = dims[0]
        one: dict[int, int] = defaultdict(int)
        one[0] -= 1
        one[shape[d]] += 1
        for b in boxes:
            one[b.offsets[d]] += 1
            one[b.offsets[d] + b.sizes[d]] -= 1
        return not any(one.values())
    if len(dims) == 2:
        d, e = dims
        two: dict[tuple[int, int], int] = defaultdict(int)
        two[0, 0] -= 1
        two[shape[d], shape[e]] -= 1
        two[shape[d], 0] += 1
        two[0, shape[e]] += 1
        for b in boxes:
            a0, a1 = b.offsets[d], b.offsets[e]
            b0, b1 = a0 + b.sizes[d], a1 + b.sizes[e]
            two[a0, a1] += 1
            two[b0, b1] += 1
            two[b0, a1] -= 1
            two[a0, b1] -= 1
        return not any(two.values())
    acc: dict[tuple[int, ...], int] = defaultdict(int)
    for lo, hi, sign in [((0,) * len(dims), tuple(shape[d] for d in dims), -1)] + [
            (tuple(b.offsets[d] for d in dims), tuple(b.offsets[d] + b.sizes[d] for d in dims), 1) for b in boxes]:
        for pick in itertools.product((0, 1), repeat=len(dims)):
            corner = tuple(h if p else l for l, h, p in zip(lo, hi, pick))
            acc[corner] += -sign if sum(pick) % 2 else sign
    return not any(acc.values())


def _find_overlap(boxes: Sequence[Box], dims: list[int]) -> tuple[Box, Box] | None:
    """Two overlapping boxes of ``boxes`` (all inside the tensor, full in every dimension not in
    ``dims``), or None; see [Note: tiling in linear time]."""
    if not dims:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    if len(dims) == 1:
        d = dims[0]
        order = sorted(boxes, key=lambda b: (b.offsets[d], b.sizes[d]))
        for a, b in zip(order, order[1:]):
            if b.offsets[d] < a.offsets[d] + a.sizes[d]:
                return a, b
        return None
    if len(dims) == 2:
        sweep, other = dims
        events = sorted([(b.offsets[sweep] + b.sizes[sweep], 0, i) for i, b in enumerate(boxes)]
                        + [(b.offsets[sweep], 1, i) for i, b in enumerate(boxes)])  # ends before starts
        active: list[tuple[int, int, int]] = []  # (lo, hi, index) in ``other``: pairwise disjoint
        for _, start, i in events:
            b = boxes[i]
            item = (b.offsets[other], b.offsets[other] + b.sizes[other], i)
            at = bisect.bisect_left(active, item)
            if not start:
                del active[at]
                continue
            if at > 0 and active[at - 1][1] > item[0]:
                return boxes[active[at - 1][2]], b
            if at < len(active) and active[at][0] < item[1]:
                return boxes[active[at][2]], b
            active.insert(at, item)
        return None
    d = max(dims, key=lambda d: len({b.offsets[d] for b in boxes}))
    opened: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets[d]):
        opened = [a for a in opened if a.offsets[d] + a.sizes[d] > b.offsets[d]]
        for a in opened:
            if a.intersect(b) is not None:
                return a, b
        opened.append(b)
    return None


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None when ``boxes`` tile a tensor of ``shape`` exactly, else one sentence saying what is
    wrong: a box of the wrong rank, a box outside the shape, an empty box, two overlapping
    boxes (the word "overlapping" and both boxes), or a hole (how many elements are missing).

    Arithmetic only (no element is materialised), so a damaged shape such as ``[2**62]`` costs
    nothing; linear in the boxes when they tile ([Note: tiling in linear time]). A tensor with
    no elements has no boxes.
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
    dims = [d for d in range(len(shape)) if any(b.offsets[d] != 0 or b.sizes[d] != shape[d] for b in boxes)]
    if boxes and _corners_match(shape, boxes, dims):
        return None
    pair = _find_overlap(boxes, dims) if boxes else None
    if pair is not None:
        return _overlap_msg(*pair)
    have = sum(b.numel for b in boxes)
    if have != total:
        return f"the boxes hold {have} of the tensor's {total} elements (a hole of {total - have})"
    return None


def saved_tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """`tiling_problem` of a tensor's saved ``boxes`` with exact duplicates left out
    (`distinct_boxes`): what ``load``, ``verify`` and ``inspect`` check of an index."""
    return tiling_problem(shape, [boxes[i] for i in distinct_boxes(boxes)])
