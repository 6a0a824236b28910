"""Issues 36 and 43: checkpoints on a real S3-compatible server (moto on 127.0.0.1, `tests._s3`)
through fsspec's s3fs: save, load at another world size, rotation, ``latest_checkpoint``, the
CLI on ``s3://`` URLs; a second process loading ``latest`` while a writer process replaces it
12 times; a writer killed at every S3 write request of a save, a replace and a rotation (nothing
committed is lost, a load right after reads the committed version, the next save cleans up);
the requests of each, none a COPY. An object store has no atomic rename: a save commits by a
pointer ([Note: commit by a pointer] in ``checkpoint/_series/_commit.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.checkpoint import CheckpointError, latest_checkpoint, load, main, save
from shardwise.checkpoint._series._series import RECORD_FILE
from shardwise.checkpoint._storage import storage_for
from tests._dist import run_ranks
from tests._s3 import Killed, S3Calls, fresh_prefix, s3_server
from tests.test_checkpoint_readers import load_while_writing


@pytest.fixture(scope="module")
def s3_env():
    with s3_server() as env:
        yield env


@pytest.fixture
def folder(s3_env):
    return fresh_prefix()


def _state(v: float) -> dict:
    return {"w": torch.full((8, 6), v), "b": torch.arange(5) + int(v), "step": int(v)}


def _value(path: str) -> float:
    got = {"w": torch.zeros(8, 6), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    load(got, path)
    v = float(got["w"][0, 0])
    assert torch.equal(got["w"], torch.full((8, 6), v)) and torch.equal(got["b"], torch.arange(5) + int(v)) \
        and got["step"] == int(v), f"a mix of versions: {got}"
    return v


def _names(url: str) -> list[str]:
    storage, path = storage_for(url)
    return storage.list(path)


def _record(url: str) -> dict:
    storage, path = storage_for(url)
    record = json.loads(storage.read_small(storage.join(path, RECORD_FILE), 1 << 20))
    return {name: sorted(c["name"] for c in s["checkpoints"]) for name, s in record["series"].items()} | {
        "pending": sum(len(s.get("pending", [])) for s in record["series"].values()),
        "deleting": sum(len(s.get("deleting", [])) for s in record["series"].values())}


def _leftovers(url: str) -> list[str]:
    """What a save left that nothing will delete: ``.incomplete-``/``.replaced-`` folders, and
    version folders (``<name>/.v-<token>``) that no pointer names and the series record does not
    list for deletion by the next save ([Note: commit by a pointer])."""
    storage, parent = storage_for(url)
    left = [n for n in _names(url) if ".incomplete-" in n or ".replaced-" in n or n.endswith(".tmp")]
    file = storage.join(parent, RECORD_FILE)
    record = json.loads(storage.read_small(file, 1 << 20)) if storage.kind(file) == "file" else {"series": {}}
    doomed = {(d["name"], v) for s in record["series"].values() for d in s.get("deleting", []) for v in d.get("old", [])}
    for name in _names(url):
        folder = storage.join(parent, name)
        if name == RECORD_FILE or name in left:
            continue
        try:
            at = json.loads(storage.read_small(storage.join(folder, "index.json"), 1 << 16)).get("at")
        except CheckpointError:
            at = None
        left += [f"{name}/{v}" for v in _names(f"{url}/{name}") if v.startswith(".v-") and v != at
                 and (name, v) not in doomed]
    return left


def _checkpoints(url: str) -> list[str]:
    """The names in ``url`` that are checkpoints (hold an ``index.json``)."""
    storage, parent = storage_for(url)
    return sorted(n for n in _names(url) if storage.kind(storage.join(parent, n, "index.json")) == "file")


# --- save and load at another world size, rotation, latest ----------------------------------------

def _save_sharded(rank, world_size, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    said = []
    for step in (1, 2, 3):
        full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10) + step
        state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": distribute_tensor(full[:, :4].clone(), mesh,
                                                                                         [Shard(1)]),
                 "step": step}
        said += save(state, f"{folder}/step-{step}", keep_last=2)
    return said


def _load_latest(rank, world_size, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    path = latest_checkpoint(folder)
    state = {"w": distribute_tensor(torch.zeros(12, 10), mesh, [Shard(1)]),
             "b": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]), "step": 0}
    load(state, path)
    return path, state["w"].full_tensor(), state["b"].full_tensor(), state["step"]


def test_save_on_two_ranks_rotate_and_load_latest_on_three_and_one(folder, s3_env):
    said = run_ranks(_save_sharded, 2, folder, timeout=120, env=s3_env)
    assert any("removed" in s and "step-1" in s for s in said[0]), said[0]
    assert _checkpoints(folder) == ["step-2", "step-3"], _names(folder)
    assert _leftovers(folder) == [], _leftovers(folder)  # step-1's version folder: the next save's
    assert _record(folder) == {"step-": ["step-2", "step-3"], "pending": 0, "deleting": 1}
    want = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10) + 3
    for path, w, b, step in run_ranks(_load_latest, 3, folder, timeout=120, env=s3_env):
        assert path == f"{folder}/step-3" and step == 3
        assert torch.equal(w, want) and torch.equal(b, want[:, :4]), "bit-exact at another world size"
    got = {"w": torch.zeros(12, 10), "b": torch.zeros(12, 4), "step": 0}
    load(got, latest_checkpoint(folder))  # one process, no process group
    assert torch.equal(got["w"], want) and got["step"] == 3


# --- the CLI on s3:// URLs -----------------------------------------------------------------------

def test_the_cli_inspects_verifies_and_merges_s3_urls(folder, capsys, tmp_path):
    from safetensors.torch import load_file

    save({"model": _state(4.0)}, f"{folder}/step-4")
    assert main(["inspect", f"{folder}/step-4"]) == 0
    assert "model/w" in capsys.readouterr().out
    assert main(["verify", f"{folder}/step-4"]) == 0
    capsys.readouterr()
    assert main(["merge", f"{folder}/step-4", str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    merged = {}
    for f in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged |= load_file(f)
    assert torch.equal(merged["w"], _state(4.0)["w"]) and torch.equal(merged["b"], _state(4.0)["b"]), merged
    assert main(["merge", f"{folder}/step-4", f"{folder}/merged"]) != 0
    err = capsys.readouterr().err
    assert "write into a local folder" in err and err.count("\n") == 1, err
    assert _names(f"{folder}") == [RECORD_FILE, "step-4"], "nothing written for the refused merge"
    storage, path = storage_for(f"{folder}/step-4")
    at = json.loads(storage.read_small(storage.join(path, "index.json"), 1 << 16))["at"]  # the pointer's folder
    data = storage.read_small(storage.join(path, at, "rank-00000.safetensors"), 1 << 20)
    data = bytearray(data)
    data[-1] ^= 0xFF  # damage the last byte of tensor data
    storage.write_atomic(storage.join(path, at, "rank-00000.safetensors"), bytes(data))
    assert main(["verify", f"{folder}/step-4"]) != 0
    err = capsys.readouterr()
    assert "checksum" in (err.out + err.err).lower() or "crc" in (err.out + err.err).lower(), err


# --- a second process loads latest while a writer process saves it 12 times --------------------

SAVES = 12
SHAPES = {"a": (128, 128), "b": (256, 64), "c": (32, 512)}  # 192 KiB per version

WRITER = f"""
import sys, torch
from shardwise.checkpoint import save
path = sys.argv[1]
for v in range(1, {SAVES} + 1):
    save({{k: torch.full(s, float(v)) for k, s in {SHAPES!r}.items()}} | {{"version": v}}, path)
    print(v, flush=True)
"""


def test_a_reader_process_sees_one_whole_version_or_a_retry_while_a_writer_saves_12_times(folder):
    path = f"{folder}/latest"
    first = subprocess.run([sys.executable, "-c", WRITER.replace(f"{SAVES} + 1", "2"), path], capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    loads, retries, out, err = load_while_writing(writer, path, SHAPES, 900)
    assert writer.returncode == 0, f"the writer failed (a reader got in its way?): {err[-2000:]}"
    assert out.split() == [str(v) for v in range(1, SAVES + 1)], out
    assert len(loads) >= 6 and len(set(loads)) >= 3, (loads, len(retries))
    assert sorted(_names(folder)) == [RECORD_FILE, "latest"], _names(folder)
    assert len(_names(path)) == 3 and _leftovers(folder) == [], _names(path)  # pointer, current, superseded
    assert _value_of(path) == SAVES
    print(f"{len(loads)} whole loads of {len(set(loads))} versions, {len(retries)} retries")


def _value_of(path: str) -> int:
    got = {k: torch.zeros(s) for k, s in SHAPES.items()} | {"version": 0}
    load(got, path)
    return got["version"]


# --- a writer killed at every S3 write request of a save ---------------------------------------

def _as_if_dead(url: str) -> None:
    """Make the series record's pending saves look like those of an exited process (the kill is
    simulated in this process, which lives on)."""
    storage, parent = storage_for(url)
    file = storage.join(parent, RECORD_FILE)
    if storage.kind(file) == "missing":
        return
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = json.loads(storage.read_small(file, 1 << 20))
    for series in record["series"].values():
        for p in series.get("pending", []):
            p["pid"] = gone.pid
    storage.write_atomic(file, json.dumps(record).encode())


def _load_right_after_kill(path: str) -> tuple[float | None, str]:
    """A load before any other save: the value read, or (None, the error's text), which never
    names damage."""
    try:
        return _value(path), ""
    except CheckpointError as e:
        text = str(e).lower()
        assert not any(w in text for w in ("checksum", "crc", "damaged", "corrupt", "truncated")), e
        return None, str(e)


def _each_kill_point(folder: str, crashing, after) -> int:
    """``crashing(folder, k)`` killed at its k-th S3 write request for every k in turn, each
    followed by ``after(folder, k, writes)`` (which loads, recovers and checks, leaving the
    folder ready for the next k: one folder, one set-up for the whole sweep); returns the
    number of write requests of an uninterrupted ``crashing``."""
    k = 0
    while True:
        k += 1
        with S3Calls(kill_at=k) as calls:
            try:
                crashing(folder, k)
            except (Killed, CheckpointError, OSError):
                assert calls.dead, "the save failed without a kill"
        _as_if_dead(folder)
        after(folder, k, calls.writes)
        if not calls.dead:
            return k - 1
        assert k < 60, "no end to the kill points"


def test_a_replace_killed_at_every_s3_write_loads_the_committed_version_and_is_recovered(folder):
    """Killed at each S3 write of a replace of ``latest`` (its deletion of the version the last
    replace superseded included), a load of ``latest`` and of `latest_checkpoint` before any
    other save reads the committed version: the old one until the pointer is written, the new
    one after; never "not a checkpoint", never "none yet". The next save then cleans up: nothing
    left that no save will delete, the user's file kept, no COPY request anywhere."""
    seen: list[tuple[int, float, float]] = []
    copies = []
    save(_state(0.5), f"{folder}/latest")
    save(_state(1.0), f"{folder}/latest")  # the crashing replace first deletes 0.5's folder
    storage, path = storage_for(f"{folder}/latest")
    storage.write_atomic(storage.join(path, "config.json"), b"{}")  # a user's file: survives every kill

    def crashing(f, k):
        save(_state(10.0 * k + 2), f"{f}/latest")

    def after(f, k, writes):
        where = f"killed at write {k} ({writes[-1] if writes else '-'})"
        old, new = (1.0 if k == 1 else 10.0 * (k - 1) + 3), 10.0 * k + 2
        by_path, error = _load_right_after_kill(f"{f}/latest")
        latest = latest_checkpoint(f)
        assert by_path in (old, new) and latest is not None, (where, error, latest)
        seen.append((k, by_path, _value(latest)))
        assert seen[-1][2] == by_path, (where, seen[-1])
        with S3Calls() as calls:
            save(_state(10.0 * k + 3), f"{f}/latest")
        copies.append(calls.counts["copy_object"] + calls.counts["upload_part_copy"])
        assert _leftovers(f) == [], (where, _leftovers(f))
        assert _value(f"{f}/latest") == 10.0 * k + 3, where
        assert "config.json" in _names(f"{f}/latest"), where
        assert len([n for n in _names(f"{f}/latest") if n.startswith(".v-")]) == 2, (where, _names(f"{f}/latest"))
        assert _record(f) == {"latest": ["latest"], "pending": 0, "deleting": 1}, (where, _record(f))

    points = _each_kill_point(folder, crashing, after)
    new_from = [k for k, v, _ in seen if v == 10.0 * k + 2]
    assert new_from and new_from == list(range(new_from[0], points + 2)), f"old, then new from the pointer on: {seen}"
    assert points >= 4 and not any(copies), (points, copies)
    print(f"{points} write requests; (kill point, load of latest, load of latest_checkpoint): {seen}")


def test_a_rotation_killed_at_every_s3_write_is_recovered(folder):
    save(_state(0.0), f"{folder}/step-0", keep_last=1)
    save(_state(1.0), f"{folder}/step-1", keep_last=1)  # step-0's folder: the crashing save deletes it

    def crashing(f, k):
        save(_state(2.0 * k), f"{f}/step-{2 * k}", keep_last=1)

    def after(f, k, writes):
        where = f"killed at write {k} ({writes[-1] if writes else '-'})"
        old = f"step-{1 if k == 1 else 2 * k - 1}"
        by_old, error = _load_right_after_kill(f"{f}/{old}")
        assert by_old is not None or "does not exist" in error or "rotated away" in error, (where, error)
        assert latest_checkpoint(f) in (f"{f}/{old}", f"{f}/step-{2 * k}"), where
        save(_state(2.0 * k + 1), f"{f}/step-{2 * k + 1}", keep_last=1)
        assert _leftovers(f) == [], (where, _leftovers(f))
        assert _checkpoints(f) == [f"step-{2 * k + 1}"], (where, _names(f))
        assert len(_names(f)) <= 4, (where, _names(f))  # the record, the checkpoint, at most two rotated away
        assert _record(f) | {"deleting": 0} == {"step-": [f"step-{2 * k + 1}"], "pending": 0, "deleting": 0}, where
        assert _value(f"{f}/step-{2 * k + 1}") == 2.0 * k + 1, where

    points = _each_kill_point(folder, crashing, after)
    assert points >= 4, points


def test_a_load_right_after_a_killed_first_save_says_interrupted_not_damaged(folder):
    """The first save of a path killed at each S3 write: before its pointer is written nothing
    is committed, and a load says the path does not exist or that a save of it was interrupted
    (retry, or the next save cleans up), never that it is not a shardwise checkpoint;
    `latest_checkpoint` says None until the save is committed."""
    said: list[str] = []

    def crashing(f, k):
        save(_state(2.0), f"{f}/first-{k}")

    def after(f, k, writes):
        value, error = _load_right_after_kill(f"{f}/first-{k}")
        latest = latest_checkpoint(f)
        assert (value is None) == (latest is None or latest != f"{f}/first-{k}"), (value, error, latest)
        said.append(error if value is None else f"loaded {value}")
        text = said[-1]
        assert "not a shardwise checkpoint" not in text and "safetensors files but no" not in text, (k, text)
        assert text == "loaded 2.0" or "does not exist" in text or "interrupted" in text, (k, text)

    points = _each_kill_point(folder, crashing, after)
    assert any("interrupted" in t for t in said), said
    save(_state(3.0), f"{folder}/first-0")  # the next save cleans up every killed one
    assert _leftovers(folder) == [] and _record(folder)["pending"] == 0, (_leftovers(folder), _record(folder))
    print(f"{points} write requests; loads right after each kill: {said}")


# --- requests per save (docs/checkpoint.md, "On an object store") --------------------------------

def test_requests_per_save_replace_rotation_and_load(folder):
    """Counts this process's S3 requests (one rank, one data file); docs/checkpoint.md quotes
    the printed figures. A second replace also deletes the version the first one superseded
    ([Note: commit by a pointer]). No save, replace or rotation sends a COPY; the bounds fail
    when a change adds requests."""
    got = {}
    for what, call in [("new", lambda: save(_state(1.0), f"{folder}/latest")),
                       ("replace", lambda: save(_state(2.0), f"{folder}/latest")),
                       ("replace again", lambda: save(_state(3.0), f"{folder}/latest")),
                       ("step-1", lambda: save(_state(1.0), f"{folder}/step-1", keep_last=1)),
                       ("rotate", lambda: save(_state(2.0), f"{folder}/step-2", keep_last=1)),
                       ("rotate again", lambda: save(_state(3.0), f"{folder}/step-3", keep_last=1)),
                       ("load", lambda: _value(f"{folder}/latest"))]:
        with S3Calls() as calls:
            call()
        writes = sum(n for m, n in calls.counts.items() if m in ("put_object", "copy_object", "delete_object",
                                                                   "delete_objects"))
        got[what] = (calls.total, writes, dict(sorted(calls.counts.items())))
        print(what, calls.total, "requests,", writes, "writes:", got[what][2])
    assert not any(c.get("copy_object") or c.get("upload_part_copy") for _, _, c in got.values()), got
    assert got["replace"][0] <= 20 and got["replace again"][0] <= 20, got
    assert got["new"][0] <= 20 and got["rotate"][0] <= 30 and got["rotate again"][0] <= 30, got
    assert got["load"][1] == 0 and got["load"][0] <= 8, got


# --- a checkpoint written in place by the copying commit (before pointers) -----------------------

def test_a_checkpoint_written_before_pointers_loads_and_a_replace_supersedes_its_files(folder, tmp_path):
    """The copying commit of earlier releases left ``<name>`` as a directory: ``index.json`` next
    to its data files (the layout a POSIX save writes, uploaded here object by object). It loads;
    a save over it writes a pointer, and the next save deletes the old files, never the user's."""
    save(_state(1.0), str(tmp_path / "old"))
    storage, path = storage_for(f"{folder}/latest")
    for name in sorted(os.listdir(tmp_path / "old")):
        storage.write_atomic(storage.join(path, name), (tmp_path / "old" / name).read_bytes())
    storage.write_atomic(storage.join(path, "config.json"), b"{}")
    assert _value(f"{folder}/latest") == 1.0
    assert main(["verify", f"{folder}/latest"]) == 0
    save(_state(2.0), f"{folder}/latest")
    assert _value(f"{folder}/latest") == 2.0
    assert "rank-00000.safetensors" in _names(f"{folder}/latest"), "kept for readers until the next save"
    save(_state(3.0), f"{folder}/latest")
    names = _names(f"{folder}/latest")
    assert _value(f"{folder}/latest") == 3.0 and "config.json" in names, names
    assert not [n for n in names if n.endswith(".safetensors") or n == ".metadata"], names
    assert _leftovers(folder) == [], _leftovers(folder)
