"""Checkpoints through the `Storage` seam: fsspec's ``memory://`` (an object store's semantics:
no atomic rename) and its local file system (``file://``), and a storage passed explicitly.

Every round trip is bit-exact; ``verify`` and ``inspect`` take the same URLs.
"""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.checkpoint import CheckpointError, load, main, save, verify_checkpoint
from shardwise.checkpoint import FsspecStorage
from shardwise.checkpoint._storage import storage_for
from tests._dist import run_ranks


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v * 10))
    return {"model": {"w": torch.randn(6, 5, generator=g) + v, "b": torch.arange(3, dtype=torch.int64) + int(v),
                      "h": torch.randn(4, dtype=torch.bfloat16, generator=g)},
            "step": int(v), "name": f"v{v}"}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(3, dtype=torch.int64),
                      "h": torch.zeros(4, dtype=torch.bfloat16)}, "step": 0, "name": ""}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and a["step"] == b["step"] \
        and a["name"] == b["name"]


@pytest.fixture(params=["memory", "file"])
def root(request, tmp_path):
    if request.param == "memory":
        url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
        yield url
        fsspec.filesystem("memory").rm(url.removeprefix("memory:/"), recursive=True)
    else:
        yield f"file://{tmp_path}"


def test_a_round_trip_through_an_fsspec_url_is_bit_exact_and_verify_and_inspect_take_it(root, capsys):
    url = f"{root}/step-1"
    save(_state(1.0), url)
    got = _zeros()
    load(got, url)
    assert _same(got, _state(1.0))
    report = verify_checkpoint(url)
    assert report.fully_checked and report.bytes_checked > 0, report
    assert main(["inspect", url]) == 0, capsys.readouterr().err
    assert "model/w" in capsys.readouterr().out
    assert main(["verify", url]) == 0


def test_a_replace_through_fsspec_keeps_user_files_and_rotation_deletes_only_the_series(root):
    storage, base = storage_for(root)
    save(_state(1.0), f"{root}/latest")
    storage.write_atomic(storage.join(base, "latest", "config.json"), b"{}")
    save(_state(2.0), f"{root}/latest")
    got = _zeros()
    load(got, f"{root}/latest")
    assert _same(got, _state(2.0)), "the replace is whole"
    assert storage.read_small(storage.join(base, "latest", "config.json"), 10) == b"{}", "the user's file was kept"
    assert not [n for n in storage.list(base) if ".replaced-" in n or ".incomplete-" in n], storage.list(base)
    for step in (1, 2, 3):
        save(_state(float(step)), f"{root}/step-{step}", keep_last=2)
    names = storage.list(base)
    assert not storage.atomic_rename or "step-1" not in names, names
    assert storage.kind(storage.join(base, "step-1", "index.json")) == "missing", "rotated away at once"
    assert {"step-2", "step-3", "latest"} <= set(names), names
    save(_state(4.0), f"{root}/step-4", keep_last=2)  # deletes step-1's version folder ([Note: commit by a pointer])
    names = storage.list(base)
    assert "step-1" not in names and {"step-3", "step-4", "latest"} <= set(names), names


def test_a_storage_can_be_passed_with_a_plain_path():
    fs = fsspec.filesystem("memory")
    storage = FsspecStorage(fs)
    where = f"/explicit-{uuid.uuid4().hex[:8]}/step-1"
    save(_state(3.0), where, storage=storage)
    assert fs.exists(where + "/index.json")
    got = _zeros()
    load(got, where, storage=storage)
    assert _same(got, _state(3.0))
    assert verify_checkpoint(where, storage=storage).fully_checked
    with pytest.raises(CheckpointError, match="does not exist"):
        load(_zeros(), where + "-missing", storage=storage)


def test_on_an_object_store_a_save_writes_its_own_folder_and_commits_by_a_pointer_written_last():
    """[Note: commit by a pointer]: nothing is copied or renamed; the data, index and marker go
    to ``ck/.v-<token>`` once, ``ck/index.json`` (the pointer) is the last write of the commit,
    and the version it replaced is deleted by the next save, not by this one."""
    fs = fsspec.filesystem("memory")
    storage = FsspecStorage(fs)
    assert not storage.atomic_rename
    base = f"/order-{uuid.uuid4().hex[:8]}"
    save(_state(1.0), base + "/ck", storage=storage)
    first = [n for n in storage.list(base + "/ck") if n.startswith(".v-")]
    events: list[tuple[str, str]] = []
    real_cp, real_mv, real_pipe, real_open = fs.cp_file, fs.mv, fs.pipe_file, fs.open
    fs.cp_file = lambda *a, **k: events.append(("copy", a[0]))
    fs.mv = lambda *a, **k: events.append(("move", a[0]))
    fs.pipe_file = lambda p, *a, **k: (events.append(("put", p)), real_pipe(p, *a, **k))[1]
    fs.open = lambda p, mode="rb", *a, **k: (events.append(("put", p)) if "w" in mode else None,
                                            real_open(p, mode, *a, **k))[1]
    try:
        save(_state(2.0), base + "/ck", storage=storage)
    finally:
        del fs.cp_file, fs.mv, fs.pipe_file, fs.open
    assert not [e for e in events if e[0] in ("copy", "move")], events
    in_ck = list(dict.fromkeys(p for _, p in events if p.startswith(base + "/ck/")))  # pipe_file opens too
    assert in_ck[-1] == base + "/ck/index.json", in_ck
    assert all(p.startswith(base + "/ck/.v-") for p in in_ck[:-1]), in_ck
    assert first and first[0] in storage.list(base + "/ck"), "the replaced version stays for its readers"
    got = _zeros()
    load(got, base + "/ck", storage=storage)
    assert _same(got, _state(2.0))
    save(_state(3.0), base + "/ck", storage=storage)
    assert first[0] not in storage.list(base + "/ck") and len(storage.list(base + "/ck")) == 3, storage.list(base + "/ck")


def _two_ranks(rank, world_size, url):
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(40.0).reshape(8, 5)
    save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 7}, url)
    got = {"w": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(1)]), "step": 0}
    load(got, url)
    return got["w"].full_tensor(), got["step"]


def test_two_ranks_save_and_load_through_a_file_url(tmp_path):
    url = f"file://{tmp_path}/step-1"
    for w, step in run_ranks(_two_ranks, 2, url, timeout=60):
        assert torch.equal(w, torch.arange(40.0).reshape(8, 5)) and step == 7
    assert sorted(os.listdir(tmp_path / "step-1")) == [".metadata", "index.json", "rank-00000.safetensors",
                                                      "rank-00001.safetensors"]


def test_a_reader_on_a_version_reads_it_whole_until_the_next_save_after_the_one_that_replaced_it():
    """The rule of [Note: commit by a pointer]: a load that read the pointer before a replace
    committed still reads that version, whole, after the commit (its files are never written
    again); the version folder is deleted only by the next save of the series, and a load still
    on it then is told to retry, never given a mix."""
    from shardwise.checkpoint._format import open_checkpoint
    from shardwise.checkpoint._load._reader import load_from_index

    storage = FsspecStorage(fsspec.filesystem("memory"))
    where = f"/grace-{uuid.uuid4().hex[:8]}/latest"
    save(_state(1.0), where, storage=storage)
    files = open_checkpoint(where, storage)  # a reader has read the pointer
    save(_state(2.0), where, storage=storage)  # a replace commits
    got = _zeros()
    load_from_index(got, files)
    assert _same(got, _state(1.0)), "the version it started on, whole"
    files.close()
    files = open_checkpoint(where, storage)  # now on version 2
    save(_state(3.0), where, storage=storage)  # supersedes 2; deletes 1
    save(_state(4.0), where, storage=storage)  # deletes 2: a reader still on it is told to retry
    with pytest.raises(CheckpointError, match="being replaced.*retry"):
        load_from_index(_zeros(), files)
    files.close()


def test_concurrent_ranged_reads_fill_every_target_exactly(monkeypatch):
    """``read_concurrency`` > 1 (an object store's default): the reads of a load run on threads,
    large ranges cut into several requests; the result is bit-exact as with one read at a time,
    for whole rows, column slices and buffered destinations."""
    from shardwise.checkpoint._load import _reads

    monkeypatch.setattr(_reads, "_PART", 40)  # cut every range into requests of at most 40 bytes
    where = f"/concurrent-{uuid.uuid4().hex[:8]}/ck"
    want = {"a": torch.randn(37, 11), "b": torch.arange(1000, dtype=torch.int64).reshape(100, 10), "c": torch.randn(5)}
    save(want, where, storage=FsspecStorage(fsspec.filesystem("memory")))
    calls, real = [], _reads.run_bounded
    monkeypatch.setattr(_reads, "run_bounded", lambda tasks, w: (calls.append((len(tasks), w)), real(tasks, w))[1])
    for conc in (1, 8):
        storage = FsspecStorage(fsspec.filesystem("memory"), read_concurrency=conc)
        got = {"a": torch.zeros(37, 11), "b": torch.zeros(100, 10, dtype=torch.int64).t().contiguous().t(),
               "c": torch.zeros(5)}
        load(got, where, storage=storage, max_read_bytes=64)
        assert all(torch.equal(got[k], want[k]) for k in want), conc
    assert calls[0][1] == 1 and calls[1][1] == 8 and calls[1][0] > calls[0][0] > 3, calls
