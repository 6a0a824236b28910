"""Coalesced reads: `preadv_into` (one system call into many buffers), `crcs_of_ranges`
(adjacent ranges read together) and a load whose adjacent pieces are read by one ``preadv``."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.checkpoint import CheckpointError, load, save
from shardwise.checkpoint._format import _safetensors_io as sio
from shardwise.checkpoint import PosixStorage
from shardwise.checkpoint._format._file_io import crcs_of_range, crcs_of_ranges, preadv_into


def _file(tmp_path, data: bytes) -> str:
    path = str(tmp_path / "data.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=400), cuts=st.lists(st.integers(0, 400), max_size=12),
       offset=st.integers(0, 50))
def test_preadv_into_fills_buffers_in_order(tmp_path_factory, data, cuts, offset):
    path = _file(tmp_path_factory.mktemp("io"), data)
    offset = min(offset, len(data) - 1)
    body = data[offset:]
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    bufs = [bytearray(b - a) for a, b in zip(bounds, bounds[1:])]
    fd = PosixStorage().open_read(path, True)
    try:
        n = preadv_into(fd, [memoryview(b) for b in bufs], offset, path)
    finally:
        fd.close()
    assert n == len(body)
    assert b"".join(bufs) == body


def test_preadv_into_more_buffers_than_one_call_takes(tmp_path):
    data = bytes(range(256)) * 12  # 3072 bytes into 3072 one-byte buffers: 3 preadv calls of 1024
    path = _file(tmp_path, data)
    bufs = [bytearray(1) for _ in data]
    fd = PosixStorage().open_read(path, True)
    try:
        preadv_into(fd, [memoryview(b) for b in bufs], 0, path)
    finally:
        fd.close()
    assert b"".join(bufs) == data


def test_preadv_into_a_short_file_names_it(tmp_path):
    path = _file(tmp_path, b"abc")
    fd = PosixStorage().open_read(path, True)
    try:
        with pytest.raises(CheckpointError, match="truncated"):
            preadv_into(fd, [memoryview(bytearray(5))], 0, path)
    finally:
        fd.close()


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=500), cuts=st.lists(st.integers(0, 500), min_size=1, max_size=10),
       keep=st.lists(st.booleans(), min_size=12, max_size=12), chunk=st.integers(1, 64),
       order=st.randoms(use_true_random=False))
def test_crcs_of_ranges_equals_one_range_at_a_time(tmp_path_factory, data, cuts, keep, chunk, order):
    """Adjacent and separate ranges, in any order, with chunked CRCs, as if read one by one."""
    path = _file(tmp_path_factory.mktemp("io"), data)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    ranges = [(a, b, chunk) for (a, b), k in zip(zip(bounds, bounds[1:]), keep) if k]  # dropped ones leave gaps
    order.shuffle(ranges)
    fd = PosixStorage().open_read(path, True)
    try:
        got = crcs_of_ranges(fd, ranges, path)
        want = [crcs_of_range(fd, a, b, path, c) for a, b, c in ranges]
    finally:
        fd.close()
    assert [g.chunks() for g in got] == [w.chunks() for w in want]
    assert [g.whole() for g in got] == [zlib.crc32(data[a:b]) for a, b, _ in ranges]


def test_a_load_reads_adjacent_pieces_with_one_preadv(tmp_path, monkeypatch):
    """Ten tensors saved one after another in one file, loaded whole: one read call, not ten."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(64, 8, generator=g) for i in range(10)}
    save(state, str(tmp_path / "c"))
    calls = []
    real = os.preadv

    def counting(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(target, str(tmp_path / "c"), verify=False)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert calls == [10], f"expected one preadv into 10 buffers, got calls with {calls} buffers"
