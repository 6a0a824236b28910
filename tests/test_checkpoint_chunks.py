"""Checksum chunks: per-chunk CRC-32s in the index, and a resharded verify load that checksums
little more than each rank loads (see [Note: checksum chunks] in
``checkpoint/_base/_checksums.py`` and [Note: verification shares] in ``checkpoint/_load/_verify_shares.py``).

Test tensors are small, so the rank functions install a tiny `ChunkRule` first (ranks are
fresh processes, so this never leaks into other tests); single-process tests use monkeypatch.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.checkpoint import CheckpointError, load, main, reshard_checkpoint, save, verify_checkpoint
from shardwise.checkpoint._base import _checksums
from shardwise.checkpoint._load import _load_checks, _reader, _verify_shares
from shardwise.checkpoint._base._checksums import ChunkedCrc, ChunkRule, crc32_combine
from shardwise.checkpoint._format import format_index, index_to_json, read_index
from shardwise.checkpoint._format._safetensors_io import StreamingWriter, read_header, tensor_bytes
from tests._dist import run_ranks
from tests.test_checkpoint import _load_mixed, _save_mixed, assert_equal_states, full, mixed_full

CHUNK = 48  # bytes: fixed-size chunks for these tests
RULE = ChunkRule(max_bytes=CHUNK, min_bytes=CHUNK)


def chunk_bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The row ranges ``[lo, hi)`` of the chunks of a box of ``rows`` rows."""
    return [(lo, min(lo + chunk_rows, rows)) for lo in range(0, rows, chunk_rows)]


def _fulls() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(50, 3, generator=g),  # 12-byte rows, 4 a chunk; saved boxes of 13 rows: 4 chunks
        "i": torch.randint(-99, 99, (40, 2), generator=g),  # 16-byte rows, 3 a chunk; boxes of 10 rows
        "x": torch.randn(6, 2, generator=g),  # boxes of 2 rows = 16 bytes: one chunk, checked whole
        "step": torch.tensor(7.0),  # plain 0-d, saved by rank 0
    }


def _state(world_size: int, zeros: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for k, t in _fulls().items():
        t = torch.zeros_like(t) if zeros else t
        out[k] = t if t.dim() == 0 else distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
    return {"t": out, "note": "chunks"}


def _save4(rank, world_size, path):
    _checksums.CHUNK_RULE = RULE
    save(_state(world_size, zeros=False), path)


def _load_recording(rank, world_size, path):
    """Load into ``world_size`` ranks with verify, recording the byte ranges this rank checksums."""
    calls, gathers = [], []
    real_read, real_gather = _load_checks.crcs_of_ranges, _load_checks.gather_json

    def spy(fd, spans, file):
        calls.extend((os.path.basename(file), begin, end) for begin, end, _ in spans)
        return real_read(fd, spans, file)

    def gather(obj, dst=0):
        gathers.append(len(json.dumps(obj)))
        return real_gather(obj, dst)

    _load_checks.crcs_of_ranges, _load_checks.gather_json = spy, gather
    state = _state(world_size, zeros=True)
    before = full(state)
    try:
        stats = load(state, path)
    except CheckpointError as e:
        return {"error": str(e), "untouched": all(torch.equal(before[k], v) for k, v in full(state).items())}
    return {"stats": stats, "calls": calls, "gathers": gathers, "got": full(state), "note": state["note"]}


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chunks") / "ckpt")
    run_ranks(_save4, 4, path)
    return path


def _units(path: str) -> list[tuple[str, int, int]]:
    """``(file, first byte, end byte)`` of every checksum unit of the checkpoint at ``path``."""
    index = read_index(path)
    out = []
    for t in index.tensors.values():
        for b in t.boxes:
            header = read_header(os.path.join(path, b.file))
            e = header.entries[b.key]
            start = header.data_start + e.begin
            if b.chunk_crc32 is None:
                out.append((b.file, start, header.data_start + e.end))
                continue
            rows = b.box.sizes[0]
            row = (e.end - e.begin) // rows
            out += [(b.file, start + lo * row, start + hi * row) for lo, hi in chunk_bounds(rows, b.chunk_rows)]
    return sorted(out)


def _checked(calls, units) -> list[tuple[str, int, int]]:
    """The units that the byte ranges ``calls`` read (consecutive chunks of a box are read as one
    range); each range must consist of whole units."""
    out = []
    for file, begin, end in calls:
        inside = [u for u in units if u[0] == file and begin <= u[1] and u[2] <= end]
        assert sum(e - b for _, b, e in inside) == end - begin, f"{(file, begin, end)} is not made of whole units"
        out += inside
    return out


def _copy(src: str, dst: str, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit is not None:
        raw = json.load(open(os.path.join(dst, "index.json")))
        edit(raw)
        raw.pop("index_sha256")  # as an index written before indexes had their own checksum
        with open(os.path.join(dst, "index.json"), "w") as f:
            f.write(format_index(raw))
    return dst


def _strip_chunks(raw: dict) -> None:
    for t in raw["tensors"].values():
        for b in t["boxes"]:
            b.pop("chunk_rows", None)
            b.pop("chunk_crc32", None)


# -- a) written, and round-tripped through the index ---------------------------------------------

def _direct(t: torch.Tensor, rows_per_chunk: int) -> tuple[int, ...]:
    data = bytes(tensor_bytes(t))
    row = len(data) // t.shape[0]
    return tuple(zlib.crc32(data[lo * row:hi * row]) for lo, hi in chunk_bounds(t.shape[0], rows_per_chunk))


def test_chunk_crcs_are_written_and_round_trip_through_the_index(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "CHUNK_RULE", ChunkRule(max_bytes=64, min_bytes=64))
    state = {"a": torch.arange(40.0).reshape(10, 4), "b": torch.tensor(3.0), "c": torch.arange(5),
             "d": torch.randn(33, 3).bfloat16()}
    save(state, tmp_path / "ck")
    raw = json.load(open(tmp_path / "ck" / "index.json"))
    boxes = {k: t["boxes"][0] for k, t in raw["tensors"].items()}
    assert boxes["a"]["chunk_rows"] == 4 and len(boxes["a"]["chunk_crc32"]) == 3 * 8, boxes["a"]
    assert boxes["d"]["chunk_rows"] == 10 and len(boxes["d"]["chunk_crc32"]) == 4 * 8, boxes["d"]
    assert "chunk_rows" not in boxes["b"] and "chunk_crc32" not in boxes["c"], "one-chunk boxes record none"
    index = read_index(str(tmp_path / "ck"))
    for k in ("a", "d"):
        b = index.tensors[k].boxes[0]
        assert b.chunk_crc32 == _direct(state[k], b.chunk_rows), k
        assert b.crc32 == zlib.crc32(bytes(tensor_bytes(state[k]))), "the whole-box CRC is kept"
    assert index_to_json(index)["tensors"] == raw["tensors"]
    assert verify_checkpoint(tmp_path / "ck").ok
    # offline tools write them too
    reshard_checkpoint(tmp_path / "ck", tmp_path / "r2", 2)
    out = read_index(str(tmp_path / "r2"))  # plain tensors stay one box, on rank 0
    assert out.tensors["a"].boxes[0].chunk_crc32 == _direct(state["a"], 4)
    assert verify_checkpoint(tmp_path / "r2").ok
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(target, tmp_path / "r2")
    assert_equal_states(target, state, "resharded")


# -- b) a resharded verify load checksums little more than it needs -----------------------------

def test_resharded_verify_load_checksums_each_chunk_once_and_little_more_than_needed(saved4):
    results = run_ranks(_load_recording, 3, saved4)
    want = _fulls()
    units = _units(saved4)
    checked = sorted(u for r in results for u in _checked(r["calls"], units))
    assert checked == units, "every unit checksummed by exactly one rank"
    index = read_index(saved4)
    for rank, r in enumerate(results):
        assert_equal_states({k.removeprefix("t/"): v for k, v in r["got"].items()}, want, f"rank {rank}")
        assert len(r["gathers"]) == 1, f"one gather of needs to rank 0, got {r['gathers']}"
        stats = r["stats"]
        assert stats.bytes_verified == sum(e - b for _, b, e in r["calls"]), stats
        touched = 0  # saved boxes this rank loads from
        for k in ("w", "i", "x"):
            n = want[k].shape[0]
            lo, hi = min(rank * -(-n // 3), n), min((rank + 1) * -(-n // 3), n)  # its rows, as Shard(0) on 3
            touched += sum(1 for b in index.tensors[f"t/{k}"].boxes
                           if b.box.offsets[0] < hi and lo < b.box.offsets[0] + b.box.sizes[0])
        assert stats.bytes_verified <= stats.bytes_needed + 2 * CHUNK * touched, (rank, stats, touched)
    assert sum(r["stats"].bytes_verified for r in results) == sum(e - b for _, b, e in units)


def _extra(results) -> int:
    return max(r["stats"].bytes_verified - r["stats"].bytes_needed for r in results)


# -- c) a corrupted chunk -----------------------------------------------------------------------

def test_a_corrupted_chunk_fails_the_load_on_every_rank_naming_its_rows(saved4, tmp_path):
    path = _copy(saved4, str(tmp_path / "bad"))
    index = read_index(path)
    (box,) = [b for b in index.tensors["t/w"].boxes if b.box.offsets == (13, 0)]
    header = read_header(os.path.join(path, box.file))
    at = header.data_start + header.entries[box.key].begin + 5 * 12 + 3  # row 5 of the box: chunk 1
    with open(os.path.join(path, box.file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    results = run_ranks(_load_recording, 3, path)
    message = results[0]["error"]
    assert all(r["error"] == message for r in results), "the same error on every rank"
    assert all(r["untouched"] for r in results), "the target was modified"
    for words in ("checksum mismatch", "rank-00001.safetensors", "key 't/w@13,0'", "tensor 't/w'",
                  "chunk 1: rows [4, 8) of the box, rows [17, 21) of the tensor", "restore it or load another"):
        assert words in message, f"{words!r} not in:\n{message}"
    report = verify_checkpoint(path)
    assert len(report.problems) == 1 and "chunk 1: rows [4, 8) of the box" in report.problems[0], report.problems
    assert main(["verify", path]) == 1


# -- d) an index without chunk fields (an older checkpoint) -------------------------------------

def test_an_index_without_chunk_fields_loads_and_verifies_with_whole_box_crcs(saved4, tmp_path):
    old = _copy(saved4, str(tmp_path / "old"), _strip_chunks)
    assert "chunk_" not in open(os.path.join(old, "index.json")).read()
    assert verify_checkpoint(old).ok
    results = run_ranks(_load_recording, 3, old)
    units = _units(old)
    assert sorted(u for r in results for u in _checked(r["calls"], units)) == units, "whole boxes, each by one rank"
    for rank, r in enumerate(results):
        assert_equal_states({k.removeprefix("t/"): v for k, v in r["got"].items()}, _fulls(), f"rank {rank}")
    chunked = run_ranks(_load_recording, 3, saved4)
    assert _extra(chunked) < _extra(results), "chunks make a resharded check read less"


# -- e) malformed chunk fields ------------------------------------------------------------------

def _bad(case: str):
    def edit(raw):
        b = raw["tensors"]["a"]["boxes"][0]
        if case == "short":
            b["chunk_crc32"] = b["chunk_crc32"][:-8]
        elif case == "not_hex":
            b["chunk_crc32"] = "g" + b["chunk_crc32"][1:]
        elif case == "number":
            b["chunk_crc32"] = 12
        elif case == "rows_zero":
            b["chunk_rows"] = 0
        elif case == "rows_text":
            b["chunk_rows"] = "4"
        elif case == "wrong_rows":
            b["chunk_rows"] = 5
        elif case == "rows_only":
            del b["chunk_crc32"]
    return edit


BAD = {
    "short": "'chunk_crc32' has 16 hex digits; 3 chunks need 24",
    "not_hex": "'chunk_crc32' must be a string of hex digits",
    "number": "'chunk_crc32' must be a string of hex digits",
    "rows_zero": "'chunk_rows' must be an integer >= 1, got 0",
    "rows_text": "'chunk_rows' must be an integer >= 1, got '4'",
    "wrong_rows": "'chunk_crc32' has 24 hex digits; 2 chunks need 16 (a box of 10 rows in chunks of 5 rows)",
    "rows_only": "has only one of 'chunk_rows' and 'chunk_crc32'",
}


@pytest.fixture
def small(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "CHUNK_RULE", ChunkRule(max_bytes=64, min_bytes=64))
    save({"a": torch.arange(40.0).reshape(10, 4)}, tmp_path / "small")
    return str(tmp_path / "small")


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_chunk_fields_are_a_clear_error(small, tmp_path, case):
    path = _copy(small, str(tmp_path / case), _bad(case))
    for run in (lambda: read_index(path), lambda: load({"a": torch.zeros(10, 4)}, path)):
        with pytest.raises(CheckpointError) as e:
            run()
        assert "is damaged: tensor 'a' box at [0, 0] (key 'a@0,0')" in str(e.value) and BAD[case] in str(e.value), \
            str(e.value)
    (problem,) = verify_checkpoint(path).problems
    assert BAD[case] in problem, problem


@pytest.mark.parametrize("field,value", [("sizes", [10.0, 4]), ("offsets", [True, 0]), ("sizes", [-10, 4]),
                                         ("shape", [10, 4.0]), ("sizes", "10")])
def test_non_integer_box_coordinates_are_a_clear_error(small, tmp_path, field, value):
    """Not a crash in the chunk arithmetic (a float row count once reached struct.unpack)."""
    def edit(raw):
        t = raw["tensors"]["a"]
        (t if field == "shape" else t["boxes"][0])[field] = value

    path = _copy(small, str(tmp_path / "coords"), edit)
    for run in (lambda: read_index(path), lambda: load({"a": torch.zeros(10, 4)}, path)):
        with pytest.raises(CheckpointError, match=f"is damaged: .*'{field}' must be a list of non-negative integers"):
            run()


def test_chunk_crcs_that_disagree_with_the_box_crc_are_reported(small, tmp_path):
    def swap(raw):
        b = raw["tensors"]["a"]["boxes"][0]
        b["chunk_crc32"] = b["chunk_crc32"][8:16] + b["chunk_crc32"][:8] + b["chunk_crc32"][16:]

    path = _copy(small, str(tmp_path / "swapped"), swap)
    problems = verify_checkpoint(path).problems
    assert len(problems) == 3 and "do not combine" in problems[-1], problems
    assert "chunk 0: rows [0, 4)" in problems[0] and "chunk 1: rows [4, 8)" in problems[1], problems
    with pytest.raises(CheckpointError, match=r"checksum mismatch .*chunk 0: rows \[0, 4\)"):
        load({"a": torch.zeros(10, 4)}, path)


# -- every dtype and placement, verified in chunks ----------------------------------------------

def _save_mixed_chunked(rank, world_size, path):
    _checksums.CHUNK_RULE = ChunkRule(max_bytes=8, min_bytes=8)
    return _save_mixed(rank, world_size, path)


def _load_mixed_stats(rank, world_size, path):
    real, seen = _reader.load_from_index, []

    def load_from_index(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    _reader.load_from_index = load_from_index  # `load` calls it: keep its LoadStats
    got, _ = _load_mixed(rank, world_size, path)
    return got, seen[0]


def test_every_dtype_and_placement_round_trips_verified_in_chunks(tmp_path):
    path = str(tmp_path / "mixed")
    run_ranks(_save_mixed_chunked, 4, path)
    raw = json.load(open(os.path.join(path, "index.json")))
    assert any("chunk_crc32" in b for t in raw["tensors"].values() for b in t["boxes"])
    want = mixed_full()
    total = sum(v.numel() * v.element_size() for v in want.values())
    for world in (1, 3):
        results = run_ranks(_load_mixed_stats, world, path)
        for rank, (got, _) in enumerate(results):
            assert_equal_states(got, want, f"load into {world} ranks, rank {rank}")
        assert sum(stats.bytes_verified for _, stats in results) == total, "each saved byte checksummed once"


# -- f) the arithmetic (hypothesis) --------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 300), per_row=st.integers(1, 50), itemsize=st.sampled_from([1, 2, 4, 8]),
       max_bytes=st.integers(1, 4096), min_bytes=st.integers(1, 4096), per_box=st.integers(1, 20),
       zero_d=st.booleans())
def test_chunk_row_ranges_partition_the_box(rows, per_row, itemsize, max_bytes, min_bytes, per_box, zero_d):
    sizes = () if zero_d else (rows, per_row)
    rows, per_row = (1, 1) if zero_d else (rows, per_row)
    rule = ChunkRule(max_bytes, min_bytes, per_box)
    r = rule.chunk_rows(sizes, itemsize)
    row_bytes = per_row * itemsize
    expect = max(1, min(max_bytes, max(min_bytes, rows * row_bytes // per_box)) // row_bytes)
    if r is None:
        assert expect >= rows, "None only for a box of one chunk"
        return
    assert r == expect and r < rows
    bounds = chunk_bounds(rows, r)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows and len(bounds) > 1
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), "consecutive, no gap or overlap"
    assert all(hi - lo == r for lo, hi in bounds[:-1]) and 0 < bounds[-1][1] - bounds[-1][0] <= r
    assert r * row_bytes <= max(max_bytes, row_bytes), "a chunk is at most max_bytes, or one row"


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=600), chunk=st.integers(1, 200), cuts=st.lists(st.integers(0, 600)))
def test_crcs_of_pieces_in_random_byte_splits_equal_the_crcs_of_the_chunks(data, chunk, cuts):
    acc = ChunkedCrc(len(data), chunk)
    points = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for a, b in zip(points, points[1:]):
        acc.update(data[a:b])
    assert acc.chunks() == tuple(zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk))
    assert acc.whole() == zlib.crc32(data)
    a, b = data[: len(data) // 3], data[len(data) // 3:]
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.uint8, torch.float32, torch.bfloat16, torch.int64]),
       shape=st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple), chunk=st.integers(1, 100),
       cuts=st.lists(st.integers(0, 800), max_size=6))
def test_streaming_writer_records_the_chunk_crcs_of_its_entries(tmp_path_factory, dtype, shape, chunk, cuts):
    t = (torch.arange(max(1, torch.Size(shape).numel())) * 37 % 251).to(dtype).reshape(shape)
    path = str(tmp_path_factory.mktemp("w") / "f.safetensors")
    w = StreamingWriter(path, [("t", dtype, shape)], chunk_rule=ChunkRule(chunk, chunk))
    flat = t.reshape(-1)
    points = [0, *sorted(c for c in cuts if c <= flat.numel()), flat.numel()]
    for a, b in zip(points, points[1:]):
        w.append(flat[a:b])  # row-major pieces of any length, chunk boundaries anywhere inside them
    sums = w.close()["t"]
    assert sums.crc32 == zlib.crc32(bytes(tensor_bytes(t)))
    r = ChunkRule(chunk, chunk).chunk_rows(shape, t.element_size())
    assert sums.chunk_rows == r
    if r is not None:
        assert sums.chunk_crc32 == _direct(t, r)
    assert torch.equal(load_file(path)["t"], t)


# -- ranks that load different tensors ----------------------------------------------------------------
def _save_two(rank, world_size, path):
    _checksums.CHUNK_RULE = RULE
    g = torch.Generator().manual_seed(5)
    save({"a": torch.randn(32, 4, generator=g), "b": torch.randn(32, 4, generator=g)}, path)


def _load_one_each(rank, world_size, path):
    """Rank 0 loads only "a", rank 1 only "b" (as pipeline stages would)."""
    key = "ab"[rank]
    state = {key: torch.zeros(32, 4)}
    try:
        stats = load(state, path, strict=False)
    except CheckpointError as e:
        return ("error", str(e), bool(state[key].count_nonzero() == 0))
    return ("ok", stats.bytes_verified, None)


def test_ranks_loading_different_tensors_check_every_chunk_of_both(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_two, 2, path)
    ok = run_ranks(_load_one_each, 2, path)
    assert [r[0] for r in ok] == ["ok", "ok"]
    assert sum(r[1] for r in ok) == 2 * 32 * 4 * 4  # every byte of a and b checked once
    index = read_index(path)
    for key in ("a", "b"):
        for b in index.tensors[key].boxes:
            rows = b.box.sizes[0]
            header = read_header(os.path.join(path, b.file))
            start = header.data_start + header.entries[b.key].begin
            for i, (lo, _) in enumerate(chunk_bounds(rows, b.chunk_rows)):
                bad = str(tmp_path / f"bad-{key}-{b.key.replace('/', '_')}-{i}")
                shutil.copytree(path, bad)
                with open(os.path.join(bad, b.file), "r+b") as f:
                    f.seek(start + lo * 16)
                    byte = f.read(1)
                    f.seek(start + lo * 16)
                    f.write(bytes([byte[0] ^ 0xFF]))
                got = run_ranks(_load_one_each, 2, bad)
                assert [r[0] for r in got] == ["error", "error"], (key, b.key, i, got)
                assert all("checksum mismatch" in r[1] and r[2] for r in got), got


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 60), size=st.integers(1, 12), world=st.integers(1, 5), salt=st.integers(0, 50),
       reads=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 60), st.integers(0, 60), st.sampled_from([4, 8])),
                      max_size=8))
def test_owned_chunks_give_each_chunk_to_one_rank_that_reads_most_of_it(rows, size, world, salt, reads):
    """Against a chunk-by-chunk reference: every chunk has exactly one owner; a chunk someone
    reads goes to a rank that reads the most of its bytes (the only one, when it is unique)."""
    readers, taken = [], set()
    for r, a, b, per_row in reads:  # each rank's row ranges disjoint, as a rank's shards are
        r, lo, hi = r % world, min(a, b, rows), min(max(a, b), rows)
        if hi > lo and not any((r, x) in taken for x in range(lo, hi)):
            taken |= {(r, x) for x in range(lo, hi)}
            readers.append((r, lo, hi, per_row))
    owners: dict[int, list[int]] = {}
    for rank in range(world):
        for p, q in _verify_shares.owned_chunks(readers, rows, size, salt, rank, world):
            for i in range(p, q):
                owners.setdefault(i, []).append(rank)
    assert sorted(owners) == list(range(len(chunk_bounds(rows, size)))), owners
    for i, (lo_c, hi_c) in enumerate(chunk_bounds(rows, size)):
        (owner,) = owners[i]
        want = {}
        for r, lo, hi, per_row in readers:
            n = min(hi, hi_c) - max(lo, lo_c)
            if n > 0:
                want[r] = want.get(r, 0) + n * per_row
        if want:
            best = max(want.values())
            assert want.get(owner) == best, (i, owner, want)
