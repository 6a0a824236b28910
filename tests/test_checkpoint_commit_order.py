"""The order of the durable steps of a commit ([Note: atomic commit] in checkpoint/_series/_commit.py).

Kill tests (``os._exit``) cannot see a missing fsync: the page cache survives a process death.
So these tests record the calls themselves, with a monotonic clock shared by all ranks, and
check: every rank's data file is fsynced before the index is opened; the index is fsynced
before it is renamed to ``index.json``; then the temporary directory is fsynced, renamed to the
checkpoint's name, and the parent directory fsynced.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise.checkpoint._format._safetensors_io as sio
import shardwise.checkpoint._storage._posix as posix
from shardwise.checkpoint import save
from tests._dist import run_ranks


def _record(patch, events: list) -> None:
    """Wrap os.fsync / os.rename / os.replace and the index's open to append (clock, what, path)."""
    real_fsync, real_rename, real_replace, real_open = os.fsync, os.rename, os.replace, open

    def fsync(fd):
        events.append((time.monotonic_ns(), "fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *a, **k):
        events.append((time.monotonic_ns(), "rename", f"{src} -> {dst}"))
        return real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        events.append((time.monotonic_ns(), "replace", f"{src} -> {dst}"))
        return real_replace(src, dst, *a, **k)

    def index_open(file, *a, **k):
        events.append((time.monotonic_ns(), "open", str(file)))
        return real_open(file, *a, **k)

    patch(os, "fsync", fsync)
    patch(os, "rename", rename)
    patch(os, "replace", replace)
    patch(posix, "open", index_open)


def check_order(events: list, path: str) -> None:
    """Raise AssertionError unless ``events`` (from every rank) show the commit order."""
    events = sorted(events)
    parent, name = os.path.dirname(path), os.path.basename(path)

    def first(pred, what):
        for i, (_, kind, arg) in enumerate(events):
            if pred(kind, arg):
                return i
        raise AssertionError(f"no {what} in {[(k, a) for _, k, a in events]}")

    data = [i for i, (_, k, a) in enumerate(events) if k == "fsync" and a.endswith(".safetensors")]
    assert data, "no data file was fsynced"
    index_open = first(lambda k, a: k == "open" and a.endswith("index.json.tmp"), "index opened")
    index_sync = first(lambda k, a: k == "fsync" and a.endswith("index.json.tmp"), "index fsynced")
    index_named = first(lambda k, a: k == "replace" and a.endswith("index.json"), "index renamed")
    dir_sync = first(lambda k, a: k == "fsync" and ".incomplete-" in a and a.rstrip("/").split("/")[-1].startswith(
        f".{name}.incomplete-"), "temporary directory fsynced")
    renamed = first(lambda k, a: k == "rename" and a.endswith(f" -> {path}"), "directory renamed into place")
    parent_sync = max(i for i, (_, k, a) in enumerate(events) if k == "fsync" and a == parent)
    assert index_sync is not None and max(data) < index_open, "a data file was fsynced after the index was started"
    assert index_open < index_sync < index_named < dir_sync < renamed < parent_sync, (
        f"commit order wrong: {[(k, a) for _, k, a in events]}")


def _state(world_size: int):
    t = torch.arange(24.0).reshape(8, 3)
    if world_size > 1:
        t = distribute_tensor(t, init_device_mesh("cpu", (world_size,)), [Shard(0)])
    return {"w": t, "b": torch.ones(2), "step": 3}


def _save_recording(rank, world_size, path):
    events: list = []
    _record(lambda obj, attr, value: setattr(obj, attr, value), events)
    save(_state(world_size), path)
    return events


def test_commit_order_single_process(tmp_path, monkeypatch):
    events: list = []
    _record(lambda obj, attr, value: monkeypatch.setattr(obj, attr, value, raising=False), events)
    path = str(tmp_path / "step-1")
    save(_state(1), path)
    check_order(events, path)


def test_commit_order_two_ranks(tmp_path):
    path = str(tmp_path / "step-1")
    per_rank = run_ranks(_save_recording, 2, path, timeout=60)
    assert any(a.endswith("rank-00001.safetensors") for _, k, a in per_rank[1] if k == "fsync")
    check_order(per_rank[0] + per_rank[1], path)


def test_the_order_check_catches_a_data_file_not_fsynced(tmp_path, monkeypatch):
    """The check is sharp: with the data file's fsync dropped it fails."""
    events: list = []
    _record(lambda obj, attr, value: monkeypatch.setattr(obj, attr, value, raising=False), events)

    def close_without_fsync(self):
        self._file.flush()
        self._file.close()
        return self.checksums

    monkeypatch.setattr(sio.StreamingWriter, "close", close_without_fsync)
    path = str(tmp_path / "step-1")
    save(_state(1), path)
    with pytest.raises(AssertionError, match="no data file was fsynced"):
        check_order(events, path)
