"""Issue 20, items 2, 6 and 10: every crash point of a save, a replace and a rotation is
recovered by the next save (or read by the next load) of the series; a rotation that cannot
delete says so and retries; a full disk and a read-only mount.

A kill is injected at the k-th durable file-system call (rename, replace, unlink, rmdir, mkdir,
fsync) of a save, for every k until the save completes: from then on every such call raises
(the process is dead: no cleanup of its own runs). The record is then made to look as if its
process had exited, and the next save of the series must leave exactly what an uninterrupted
run leaves: the checkpoints ``keep_last`` keeps, no ``.incomplete-``/``.replaced-``/``.tmp``
entry, a record that lists exactly those checkpoints, the user's files in place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from shardwise.checkpoint import CheckpointError, load, save
from shardwise.checkpoint._series._series import RECORD_FILE

_CALLS = ("rename", "replace", "unlink", "rmdir", "mkdir", "fsync")


class _Killed(BaseException):
    """The process died: nothing catches it."""


def _state(v: float) -> dict:
    return {"w": torch.full((4, 3), v), "b": torch.arange(5) + int(v), "step": int(v)}


def _value(path) -> float:
    got = {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    load(got, path)
    v = float(got["w"][0, 0])
    assert torch.equal(got["w"], torch.full((4, 3), v)) and torch.equal(got["b"], torch.arange(5) + int(v)) \
        and got["step"] == int(v), f"a mix of versions: {got}"
    return v


def _as_if_dead(folder) -> None:
    file = os.path.join(folder, RECORD_FILE)
    if not os.path.exists(file):
        return
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = json.loads(open(file).read())
    for series in record["series"].values():
        for p in series.get("pending", []):
            p["pid"] = gone.pid
    with open(file, "w") as f:
        f.write(json.dumps(record))


def _kill_at(monkeypatch, k: int) -> list[str]:
    """Make the k-th durable call raise `_Killed`, and every call after it; returns the log."""
    log: list[str] = []
    dead = []

    def wrap(name, real):
        def call(*a, **kw):
            if dead:
                raise _Killed()
            log.append(f"{name} {a[0] if a else ''}")
            if len(log) == k:
                dead.append(True)
                raise _Killed()
            return real(*a, **kw)
        return call

    for name in _CALLS:
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    return log


def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".incomplete-" in n or ".replaced-" in n or n.endswith(".tmp"))


def _recorded(folder) -> dict:
    record = json.loads(open(os.path.join(folder, RECORD_FILE)).read())
    return {name: sorted(c["name"] for c in s["checkpoints"]) for name, s in record["series"].items()} | {
        "pending": sum(len(s.get("pending", [])) for s in record["series"].values()),
        "deleting": sum(len(s.get("deleting", [])) for s in record["series"].values())}


def _each_crash_point(tmp_path, monkeypatch, before, crashing, after, check) -> int:
    """Run ``before(folder)``, then ``crashing(folder)`` killed at every crash point in turn
    (a fresh folder each), then ``after(folder)`` and ``check(folder, k)``; returns the count."""
    k = 0
    while True:
        k += 1
        folder = str(tmp_path / f"k{k}")
        os.makedirs(folder)
        before(folder)
        with monkeypatch.context() as m:
            log = _kill_at(m, k)
            try:
                crashing(folder)
                finished = True
            except _Killed:
                finished = False
        _as_if_dead(folder)
        after(folder)
        check(folder, k, log)
        shutil.rmtree(folder)
        if finished:
            return k - 1
        assert k < 200, "no end to the crash points"


def test_every_crash_point_of_a_replace_is_recovered(tmp_path, monkeypatch):
    def before(folder):
        save(_state(1.0), os.path.join(folder, "latest"))
        with open(os.path.join(folder, "latest", "config.json"), "w") as f:
            f.write("{}")  # a user's file: survives every crash

    def after(folder):
        v = _value(os.path.join(folder, "latest"))  # a load right after the crash: one whole version
        assert v in (1.0, 2.0), v
        save(_state(3.0), os.path.join(folder, "latest"))

    def check(folder, k, log):
        where = f"killed at call {k} ({log[-1] if log else '-'})"
        assert _leftovers(folder) == [], (where, _leftovers(folder))
        assert _value(os.path.join(folder, "latest")) == 3.0, where
        assert os.path.exists(os.path.join(folder, "latest", "config.json")), where
        assert _recorded(folder) == {"latest": ["latest"], "pending": 0, "deleting": 0}, (where, _recorded(folder))

    points = _each_crash_point(tmp_path, monkeypatch, before,
                               lambda f: save(_state(2.0), os.path.join(f, "latest")), after, check)
    assert points >= 8, points


def test_every_crash_point_of_a_rotation_is_recovered(tmp_path, monkeypatch):
    def before(folder):
        save(_state(1.0), os.path.join(folder, "step-1"), keep_last=1)

    def after(folder):
        save(_state(3.0), os.path.join(folder, "step-3"), keep_last=1)

    def check(folder, k, log):
        where = f"killed at call {k} ({log[-1] if log else '-'})"
        assert _leftovers(folder) == [], (where, _leftovers(folder))
        assert sorted(os.listdir(folder)) == [RECORD_FILE, "step-3"], (where, sorted(os.listdir(folder)))
        assert _recorded(folder) == {"step-": ["step-3"], "pending": 0, "deleting": 0}, (where, _recorded(folder))
        assert _value(os.path.join(folder, "step-3")) == 3.0

    points = _each_crash_point(tmp_path, monkeypatch, before,
                               lambda f: save(_state(2.0), os.path.join(f, "step-2"), keep_last=1), after, check)
    assert points >= 8, points


def test_keep_last_that_cannot_delete_says_so_and_retries(tmp_path, monkeypatch):
    """Issue 20 item 6: no "removed" for a deletion that did not happen, and it is not forgotten."""
    save(_state(1.0), tmp_path / "step-1", keep_last=1)
    real = os.unlink

    def refuse(path, *a, **k):
        if "step-1" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", refuse)
        said = save(_state(2.0), tmp_path / "step-2", keep_last=1)
    assert not any("removed" in s and "step-1" in s for s in said), said
    assert any("could not remove" in s and "step-1" in s for s in said), said
    assert _value(tmp_path / "step-1") == 1.0 or not os.path.exists(tmp_path / "step-1" / "index.json")
    said = save(_state(3.0), tmp_path / "step-3", keep_last=1)
    assert any("removed" in s and "step-1" in s for s in said), said
    assert sorted(os.listdir(tmp_path)) == [RECORD_FILE, "step-3"], sorted(os.listdir(tmp_path))


def _mount(args: list[str]) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    if os.geteuid() != 0 or not _mount(["-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)]):
        pytest.skip("needs root and mount (a 2 MiB tmpfs)")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_save_on_a_full_disk_leaves_no_temporary_file_and_no_stale_record(small_disk):
    """Issue 20 item 10: nothing of the failed save remains once the disk has room again."""
    save(_state(1.0), small_disk / "step-1")
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096) > 0:
            pass
    except OSError:
        pass  # the disk is full
    finally:
        os.close(fd)
    with pytest.raises((CheckpointError, OSError)):
        save(_state(2.0), small_disk / "step-2")
    assert _leftovers(small_disk) == [], _leftovers(small_disk)
    os.unlink(filler)
    save(_state(3.0), small_disk / "step-3")
    assert _leftovers(small_disk) == [] and not os.path.exists(small_disk / "step-2")
    assert _recorded(small_disk) == {"step-": ["step-1", "step-3"], "pending": 0, "deleting": 0}, _recorded(small_disk)


def test_load_reads_the_intact_old_copy_on_a_read_only_mount(tmp_path, monkeypatch):
    """Issue 20 item 10: a replace stopped between its renames, then the folder mounted read-only."""
    folder = tmp_path / "ro"
    folder.mkdir()
    save(_state(1.0), folder / "latest")
    with monkeypatch.context() as m:
        _kill_at(m, [c.split()[0] for c in _probe_calls(tmp_path)].index("rename") + 2)
        with pytest.raises(_Killed):
            save(_state(2.0), folder / "latest")
    assert not os.path.exists(folder / "latest") and any(".replaced-" in n for n in os.listdir(folder))
    if os.geteuid() != 0 or not _mount(["--bind", "-o", "ro", str(folder), str(folder)]):
        pytest.skip("needs root and mount (a read-only bind mount)")
    try:
        with pytest.raises(OSError):
            open(folder / "probe", "w")
        assert _value(folder / "latest") == 1.0
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def _probe_calls(tmp_path) -> list[str]:
    """The durable calls of a replace, in order (to find the second rename's position)."""
    folder = tmp_path / "probe"
    folder.mkdir()
    save(_state(1.0), folder / "latest")
    mp = pytest.MonkeyPatch()
    try:
        log = _kill_at(mp, 10 ** 9)
        save(_state(2.0), folder / "latest")
    finally:
        mp.undo()
    shutil.rmtree(folder)
    return log
