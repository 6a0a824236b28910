"""`_tiling.tiling_problem` against a brute-force reference that counts every cell (hypothesis),
and the owner assignment of `_owners.assign_writers` in one process."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint._geometry._boxes import Box
from shardwise.checkpoint._geometry._owners import assign_writers
from shardwise.checkpoint._geometry._tiling import distinct_boxes, tiling_problem

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


def reference(shape: tuple[int, ...], boxes: list[Box]) -> str:
    """"ok", "outside", "empty", "overlap" or "hole", by visiting every cell of the tensor."""
    for b in boxes:
        if len(b.sizes) != len(shape) or any(o + s > n for o, s, n in zip(b.offsets, b.sizes, shape)):
            return "outside"
        if math.prod(b.sizes) == 0:
            return "empty"
    count = {cell: 0 for cell in itertools.product(*(range(n) for n in shape))}
    for b in boxes:
        for cell in itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.sizes))):
            count[cell] += 1
    if any(c > 1 for c in count.values()):
        return "overlap"
    if any(c == 0 for c in count.values()):
        return "hole"
    return "ok"


@st.composite
def box_in(draw, shape, slack: int):
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n + slack))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, max(n - lo, 0) + slack)))
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def grid(draw, shape):
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3)) if n > 1 else set()
        points = [0, *sorted(inner), n]
        cuts.append([(a, b - a) for a, b in zip(points, points[1:]) if b > a])
    return [Box(tuple(c[0] for c in cell), tuple(c[1] for c in cell)) for cell in itertools.product(*cuts)]


def _kind(problem: str | None) -> str:
    if problem is None:
        return "ok"
    for word, kind in (("outside", "outside"), ("dimensions", "outside"), ("empty", "empty"),
                       ("overlapping", "overlap"), ("hole", "hole")):
        if word in problem:
            return kind
    raise AssertionError(problem)


@given(st.data(), shapes)
@settings(max_examples=300, deadline=None)
def test_tiling_problem_agrees_with_counting_every_cell(data, shape):
    """Random box sets: exact grids, grids with a box dropped, duplicated, moved or grown, and
    boxes drawn at random (sometimes outside)."""
    boxes = data.draw(grid(shape)) if math.prod(shape) else []
    how = data.draw(st.sampled_from(["exact", "drop", "duplicate", "move", "random"]))
    if how == "drop" and boxes:
        boxes.pop(data.draw(st.integers(0, len(boxes) - 1)))
    elif how == "duplicate" and boxes:
        boxes.append(boxes[data.draw(st.integers(0, len(boxes) - 1))])
    elif how == "move" and boxes:
        boxes[data.draw(st.integers(0, len(boxes) - 1))] = data.draw(box_in(shape, 0))
    elif how == "random":
        boxes = data.draw(st.lists(box_in(shape, data.draw(st.integers(0, 1))), max_size=5))
    want = reference(shape, boxes)
    got = _kind(tiling_problem(shape, boxes))
    assert got == want, (shape, boxes, tiling_problem(shape, boxes))


@given(st.data(), shapes)
@settings(max_examples=100, deadline=None)
def test_exact_duplicates_are_dropped_and_then_tile(data, shape):
    boxes = data.draw(grid(shape)) if math.prod(shape) else []
    doubled = boxes + boxes[: data.draw(st.integers(0, len(boxes)))]
    keep = distinct_boxes(doubled)
    assert keep == list(range(len(boxes)))
    assert tiling_problem(shape, [doubled[i] for i in keep]) is None


def test_a_huge_damaged_shape_is_arithmetic_only():
    assert "hole" in tiling_problem((2 ** 62, 3), [Box((0, 0), (4, 3))])


def test_assign_writers_one_process():
    held = {"a": [Box((0,), (4,))], "b": [Box((0, 0), (2, 2)), Box((1, 1), (1, 1))]}
    mine, problem = assign_writers(["a", "b"], {"a": (4,), "b": (2, 2)}, held, "digest", 0)
    assert "overlapping" in problem and "'b'" in problem and mine == set()
    mine, problem = assign_writers(["a"], {"a": (4,)}, {"a": held["a"]}, "digest", 0)
    assert problem is None and mine == {("a", Box((0,), (4,)))}


def test_corner_digests_of_a_tiling_sum_to_the_tensor_s_and_others_do_not():
    from shardwise.checkpoint._geometry import CORNER_PRIME, corner_digest

    def summed(parts):
        digests = [corner_digest(p) for p in parts]
        return tuple(sum(d[i] for d in digests) % CORNER_PRIME for i in range(2))

    full = corner_digest([Box((0, 0), (6, 4))])
    tiles = [[Box((0, 0), (3, 4))], [Box((3, 0), (3, 2)), Box((3, 2), (3, 2))]]  # two ranks, 3 boxes
    assert summed(tiles) == full
    assert summed([[Box((0, 0), (3, 4))], [Box((2, 0), (4, 4))]]) != full  # overlap, sizes past the end
    assert summed([[Box((0, 0), (3, 4))], [Box((3, 0), (2, 4))]]) != full  # a gap
    assert summed([[Box((0, 0), (3, 4))], [Box((0, 0), (3, 4))]]) != full  # the top half twice
