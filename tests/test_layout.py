"""Index arithmetic of dim-0 sharding (composable/_fsdp/_layout.py), over random shapes and worlds."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable._chunks import chunk_range, chunk_sizes
from shardwise.composable._fsdp._layout import DimLayout, byte_columns

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)
worlds = st.integers(1, 8)


@given(shapes, worlds)
def test_shards_tile_dim0_like_torch_chunk(shape, world):
    lay = DimLayout(shape, world)
    chunks = torch.empty(shape).chunk(world, dim=0) if shape[0] else ()
    covered = 0
    for r in range(world):
        start, rows = lay.shard_start(r), lay.shard_rows(r)
        assert start == covered, "shards are contiguous and in rank order"
        expected = chunks[r].shape[0] if r < len(chunks) else 0
        assert rows == expected
        assert 0 <= rows <= lay.chunk_rows
        assert lay.shard_shape(r) == (rows, *shape[1:])
        covered += rows
    assert covered == shape[0]
    assert lay.padded_numel * world >= lay.rows * lay.row_numel
    assert lay.full_ranks * lay.chunk_rows + lay.tail_rows == lay.rows
    assert lay.tail_rows < max(lay.chunk_rows, 1)


@given(shapes, worlds, st.data())
@settings(max_examples=60)
def test_scatter_then_gather_round_trips_and_zero_pads(shape, world, data):
    lay = DimLayout(shape, world)
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    # a strided destination: the column block of a wider rank-major buffer, as in a unit
    extra = data.draw(st.integers(0, 3))
    buf = torch.full((world, lay.padded_numel + extra), -1.0)
    block = buf[:, extra:]
    lay.scatter(full, block, 0, world)
    assert (buf[:, :extra] == -1).all(), "writes stay inside the block"
    out = torch.empty(shape)
    lay.gather(block, out)
    assert torch.equal(out, full)
    for r in range(world):
        real = lay.shard_rows(r) * lay.row_numel
        assert torch.equal(block[r, :real], full.reshape(-1)[lay.shard_start(r) * lay.row_numel :][:real])
        assert (block[r, real:] == 0).all(), "padding is zero"


@given(shapes, worlds, st.data())
@settings(max_examples=60)
def test_scatter_of_a_rank_range_matches_the_full_scatter(shape, world, data):
    lay = DimLayout(shape, world)
    lo = data.draw(st.integers(0, world))
    hi = data.draw(st.integers(lo, world))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    whole = torch.empty(world, lay.padded_numel)
    lay.scatter(full, whole, 0, world)
    part = torch.empty(hi - lo, lay.padded_numel)
    lay.scatter(full, part, lo, hi)
    assert torch.equal(part, whole[lo:hi])


def test_zero_dim_tensor_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="0-d"):
        DimLayout((), 2)


@given(st.integers(0, 40), worlds)
def test_chunk_range_and_sizes_are_torch_chunk(n, parts):
    # the one torch.chunk arithmetic shared by fully_shard's layout and the TP layouts
    pieces = torch.arange(n).chunk(parts) if n else ()
    for r in range(parts):
        start, stop = chunk_range(n, parts, r)
        want = pieces[r].tolist() if r < len(pieces) else []
        assert list(range(start, stop)) == want, (n, parts, r, start, stop)
    assert chunk_sizes(n, parts) == [len(p) for p in pieces] + [0] * (parts - len(pieces))


def test_byte_columns_is_one_tensors_block_of_every_rank_row():
    lay = DimLayout((3, 2), 2)  # 2 rows of 2 per rank, padded: 4 elements
    rows = torch.zeros(2, 8 + 16, dtype=torch.uint8)  # 8 bytes of another tensor, then this one
    block = byte_columns(rows, 8, lay, torch.float32)
    assert block.shape == (2, 4) and block.dtype == torch.float32
    block.copy_(torch.arange(8.0).view(2, 4))
    assert torch.equal(rows[:, 8:24].view(torch.float32), torch.arange(8.0).view(2, 4))
    assert not rows[:, :8].any(), "bytes before the offset untouched"


@given(shapes, worlds, st.data())
@settings(max_examples=120)
def test_any_dim_layout_matches_torch_chunk_and_round_trips(shape, world, data):
    """``Shard(d)`` for any ``d``: each rank's real shard (a view of its padded segment) is
    ``torch.chunk(full, world, d)[rank]``; scatter then gather gives the tensor back."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    lay = DimLayout(shape, world, dim)
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    block = torch.full((world, lay.padded_numel + 1), -1.0)[:, 1:]
    lay.scatter(full, block, 0, world)
    out = torch.empty(shape)
    lay.gather(block, out)
    assert torch.equal(out, full)
    pieces = full.chunk(world, dim) if shape[dim] else ()
    for r in range(world):
        seg = block[r].contiguous()
        local = lay.local_view(seg, r)
        want = pieces[r] if r < len(pieces) else full.narrow(dim, 0, 0)
        assert local.shape == want.shape == lay.shard_shape(r), (shape, world, dim, r)
        assert torch.equal(local, want), (shape, world, dim, r)
        if local.numel():
            assert local.untyped_storage().data_ptr() == seg.untyped_storage().data_ptr(), "a view, not a copy"
        assert seg.sum() == want.sum(), "the padding is zero"
