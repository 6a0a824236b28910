"""The zigzag layout's helpers: sharding tokens / targets / positions / masks, unsharding
outputs, and the errors for lengths the layout cannot cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch

from shardwise.composable import shard_sequence, unshard_sequence, zigzag_chunks, zigzag_positions
from tests._dist import run_ranks


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 8), n=st.integers(1, 4), dim=st.sampled_from([0, 1, -1]))
def test_shards_are_the_zigzag_chunks_and_cover_the_sequence(cp, n, dim):
    seq = 2 * cp * n
    shapes = {1: (3, seq, 2), 0: (seq, 2), -1: (2, seq)}  # [B, T, ...], [T, ...], [B, T] as the last dim
    x = torch.arange(2 * 3 * seq).view(*shapes[dim]) if dim == 1 else torch.arange(2 * seq).view(*shapes[dim])
    d = dim % x.ndim
    pos = torch.arange(seq)
    seen = []
    for r in range(cp):
        shard = shard_sequence(x, r, cp, dim=dim)
        assert shard.shape[d] == 2 * n
        p = zigzag_positions(seq, r, cp)
        assert torch.equal(shard, x.index_select(d, p)), (r, cp)
        assert torch.equal(shard_sequence(pos, r, cp, dim=0), p)
        a, b = zigzag_chunks(r, cp)
        assert a + b == 2 * cp - 1
        seen += p.tolist()
    assert sorted(seen) == list(range(seq))


def test_lengths_the_layout_cannot_cut_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp = 4"):
        shard_sequence(torch.zeros(1, 6), 0, 2)
    with pytest.raises(ValueError, match="rank=2 must be in"):
        zigzag_chunks(2, 2)


def _round_trip(rank, world_size):
    x = torch.arange(2 * 4 * world_size * 3, dtype=torch.float32).view(2, 4 * world_size, 3)
    back = unshard_sequence(shard_sequence(x, rank, world_size, dim=1), dim=1)
    pos = unshard_sequence(zigzag_positions(4 * world_size, rank, world_size), dim=0)
    return torch.equal(back, x), torch.equal(pos, torch.arange(4 * world_size))


@pytest.mark.parametrize("cp", [2, 4])
def test_unshard_gives_the_global_sequence(cp):
    assert run_ranks(_round_trip, cp, timeout=60) == [(True, True)] * cp
