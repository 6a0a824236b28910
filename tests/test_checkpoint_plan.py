"""Box arithmetic of shardwise.checkpoint over random shapes, layouts and partitions (hypothesis).

No processes: boxes of DTensor placements are computed from mesh coordinates, and reads are
executed on in-memory tensors.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

from shardwise.checkpoint._geometry._boxes import Box, LocalBox, _contiguous_box, boxes_for, chunk_span, strided_positions
from shardwise.checkpoint._state._flatten import flatten, join_key
from shardwise.checkpoint._geometry._plan import covered_numel, partition_problem, plan_reads, split
from shardwise.checkpoint._format._file_io import contiguous_run

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@st.composite
def grid_partition(draw, shape):
    """Disjoint boxes covering ``shape``: random cut points per dimension, the cells of the grid."""
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3)) if n > 1 else set()
        points = [0, *sorted(inner), n]
        cuts.append([(a, b - a) for a, b in zip(points, points[1:]) if b > a] or [(0, 0)])
    boxes = [Box(tuple(c[0] for c in cell), tuple(c[1] for c in cell)) for cell in itertools.product(*cuts)]
    return [b for b in boxes if b.numel] if math.prod(shape) else []


@st.composite
def dest_box(draw, shape):
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, n - lo)))
    return Box(tuple(offsets), tuple(sizes))


@given(st.data(), shapes)
@settings(max_examples=150, deadline=None)
def test_reads_planned_from_any_partition_rebuild_any_box_exactly(data, shape):
    saved = data.draw(grid_partition(shape))
    assert partition_problem(shape, saved) is None
    dest = data.draw(dest_box(shape))
    local_offsets = tuple(data.draw(st.integers(0, 2)) for _ in shape)
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    pieces = [full[b.slices()].clone() for b in saved]
    local = torch.full(tuple(o + s + 1 for o, s in zip(local_offsets, dest.sizes)), -1, dtype=torch.int64)
    items = plan_reads(LocalBox(dest, local_offsets), saved)
    assert covered_numel(items) == dest.numel
    max_numel = data.draw(st.integers(1, 12))
    for it in items:
        parts = split(it, max_numel)
        assert all(p.src.numel <= max_numel or p.src.numel == 1 for p in parts)
        assert sum(p.src.numel for p in parts) == it.src.numel
        for p in parts:
            local[p.dst.slices()] = pieces[p.source][p.src.slices()]
    region = tuple(slice(o, o + s) for o, s in zip(local_offsets, dest.sizes))
    assert torch.equal(local[region], full[dest.slices()])
    untouched = local.clone()
    untouched[region] = -1
    assert (untouched == -1).all(), "nothing outside the destination box is written"


@given(st.data(), st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple))
@settings(max_examples=100, deadline=None)
def test_overlaps_gaps_and_outside_boxes_are_found(data, shape):
    saved = data.draw(grid_partition(shape))
    victim = data.draw(st.integers(0, len(saved) - 1))
    assert "elements" in partition_problem(shape, saved[:victim] + saved[victim + 1:])
    assert "overlap" in partition_problem(shape, saved + [saved[victim]])
    b = saved[victim]
    outside = Box(b.offsets, tuple(s + 1 if i == 0 else s for i, s in enumerate(b.sizes)))
    if outside.ends[0] > shape[0]:
        assert "outside" in partition_problem(shape, saved[:victim] + [outside] + saved[victim + 1:])


placements = st.sampled_from(["R", "S0", "S1", "S2", "SS0", "SS1"])


@given(shapes, st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
@settings(max_examples=150, deadline=None)
def test_boxes_of_placements_tile_the_tensor_once_and_match_torch(shape, mesh_shape, data):
    kinds = data.draw(st.lists(placements, min_size=len(mesh_shape), max_size=len(mesh_shape)))
    plc = []
    for kind in kinds:
        dim = int(kind[-1]) if kind != "R" else 0
        if kind == "R" or dim >= len(shape):
            plc.append(Replicate())
        elif kind.startswith("SS"):
            plc.append(_StridedShard(dim, split_factor=data.draw(st.integers(1, 3))))
        else:
            plc.append(Shard(dim))
    written = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        boxes = boxes_for(shape, mesh_shape, coord, plc)
        want_shape, want_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), plc)
        local = torch.zeros(want_shape)
        for lb in boxes:  # the boxes fill the local tensor exactly once
            local[lb.local_region().slices()] += 1
        assert bool((local == 1).all()), (coord, plc, boxes)
        if boxes and all(not isinstance(p, _StridedShard) for p in plc):
            assert len(boxes) == 1 and boxes[0].box.offsets == tuple(want_offset), (coord, plc, boxes)
        if all(c == 0 for c, p in zip(coord, plc) if isinstance(p, Replicate)):
            written += [lb.box for lb in boxes]
    assert partition_problem(shape, written) is None, (plc, written)


@given(st.integers(0, 40), st.integers(1, 9), st.data())
@settings(max_examples=200, deadline=None)
def test_chunk_span_is_torch_chunk(n, parts, data):
    """Oracle: ``torch.chunk`` of ``arange(n)`` (missing trailing pieces are empty)."""
    pieces = list(torch.arange(n).chunk(parts)) if n else []
    i = data.draw(st.integers(0, parts - 1))
    start, size = chunk_span(n, parts, i)
    want = pieces[i].tolist() if i < len(pieces) else []
    assert list(range(start, start + size)) == want, (n, parts, i, want)
    assert sum(chunk_span(n, parts, j)[1] for j in range(parts)) == n


@given(st.integers(0, 40), st.integers(1, 5), st.integers(1, 5), st.data())
@settings(max_examples=200, deadline=None)
def test_strided_positions_match_torch_strided_shard(n, split_factor, axis_size, data):
    """Oracle: torch's own offsets of a ``_StridedShard`` (``ALL`` mode); and every position is held once."""
    coord = data.draw(st.integers(0, axis_size - 1))
    size, want = _StridedShard(0, split_factor=split_factor).local_shard_size_and_offset(
        n, axis_size, coord, _StridedShardOffsetMode.ALL)
    got = strided_positions(n, split_factor, axis_size, coord)
    assert got == list(want or []) and len(got) == size, (n, split_factor, axis_size, coord, got, want)
    every = sorted(i for c in range(axis_size) for i in strided_positions(n, split_factor, axis_size, c))
    assert every == list(range(n))


@given(shapes, st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
@settings(max_examples=150, deadline=None)
def test_contiguous_box_matches_torch_local_shape_and_offset(shape, mesh_shape, data):
    """Oracle: torch's ``compute_local_shape_and_global_offset`` for Shard/Replicate placements."""
    plc = []
    for _ in mesh_shape:
        dim = data.draw(st.integers(-1, len(shape) - 1))
        plc.append(Replicate() if dim < 0 else Shard(dim))
    coord = [data.draw(st.integers(0, n - 1)) for n in mesh_shape]
    want_shape, want_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, plc)
    got = _contiguous_box(shape, mesh_shape, coord, plc)
    if math.prod(want_shape) == 0:
        assert got == [], (shape, mesh_shape, coord, plc, got)
    else:
        assert got == [LocalBox(Box(tuple(want_offset), tuple(want_shape)), (0,) * len(shape))], (got, want_offset)
    assert boxes_for(shape, mesh_shape, coord, plc) == got


def test_flat_keys_escape_slashes_and_tildes():
    assert join_key(("a/b", "c~d", 3)) == "a~1b/c~0d/3"
    state = {"m": {"w": torch.zeros(1), "n": {"k": 1}}, "lst": [torch.ones(1), "x"], "g": [{"lr": 0.1}]}
    assert [leaf.key for leaf in flatten(state)] == ["m/w", "m/n/k", "lst/0", "lst/1", "g"]


@given(st.data(), shapes)
@settings(max_examples=150, deadline=None)
def test_contiguous_runs_are_found_exactly(data, shape):
    """A region read with one ranged read must be exactly one run of the row-major elements."""
    region = data.draw(dest_box(shape))
    if region.numel == 0:
        return
    flat = torch.arange(math.prod(shape)).reshape(shape)[region.slices()].reshape(-1)
    is_run = bool((flat[1:] - flat[:-1] == 1).all())
    run = contiguous_run(region.offsets, region.sizes, shape)
    assert (run is not None) == is_run, (shape, region, run)
    if run is not None:
        assert run == (int(flat[0]), flat.numel())
