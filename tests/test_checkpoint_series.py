"""Issue 12 items 2, 4 and 5: leftovers, replace, rotation, merge/reshard targets, async saves
never waited for, and ``load(strict=False)`` that matches nothing. One process (no
torch.distributed) except where said: the commit and the series record are rank 0's work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.checkpoint import CheckpointError, load, main, merge_checkpoint, reshard_checkpoint, save
from shardwise.checkpoint._series._series import RECORD_FILE


class _Killed(BaseException):
    """Stands for the process dying: nothing catches it, so no cleanup runs."""


def _state(v: float, step: int = 1) -> dict:
    return {"w": torch.full((4, 3), v), "step": step}


def _loaded(path) -> dict:
    state = _state(0.0, 0)
    load(state, path)
    return state


def _as_if_dead(folder) -> None:
    """The series record's pending saves, as if their process had died (a pid that has exited)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    file = os.path.join(folder, RECORD_FILE)
    record = json.loads(open(file).read())
    for series in record["series"].values():
        for p in series["pending"]:
            p["pid"] = gone.pid
    open(file, "w").write(json.dumps(record))


def _kill_at_rename(monkeypatch, nth: int) -> None:
    """Make the ``nth`` os.rename of the commit (1-based) kill the save."""
    real, calls = os.rename, []

    def rename(src, dst, *a, **k):
        calls.append(src)
        if len(calls) == nth:
            raise _Killed()
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)


def test_a_killed_save_leaves_an_incomplete_dir_that_the_next_save_removes(tmp_path, monkeypatch):
    save(_state(1.0), tmp_path / "step-1")
    with monkeypatch.context() as m:
        _kill_at_rename(m, 1)
        with pytest.raises(_Killed):
            save(_state(2.0), tmp_path / "step-2")
    left = [n for n in os.listdir(tmp_path) if ".incomplete-" in n]
    assert len(left) == 1, os.listdir(tmp_path)
    save(_state(3.0), tmp_path / "step-3")
    assert os.path.exists(tmp_path / left[0]), "a pending save of a live process is left alone"
    _as_if_dead(tmp_path)
    said = save(_state(3.0), tmp_path / "step-3")
    assert any("removed" in s and left[0] in s for s in said), said
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".shardwise")) == ["step-1", "step-3"]


def test_a_crash_between_the_two_renames_of_a_replace_is_recovered_by_load(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    save(_state(1.0), path)
    with monkeypatch.context() as m:
        _kill_at_rename(m, 2)  # the old copy is renamed away, the new one not yet in place
        with pytest.raises(_Killed):
            save(_state(2.0), path)
    assert not os.path.exists(path) and any(".replaced-" in n for n in os.listdir(tmp_path))
    before = sorted(os.listdir(tmp_path))
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 1.0)), "load reads the intact old copy"
    # issue 20 (1, 10): a reader never repairs a writer's state (it may be a replace under way,
    # or a read-only mount); the next save of the series restores it
    assert sorted(os.listdir(tmp_path)) == before, "load renamed nothing"
    _as_if_dead(tmp_path)
    said = save(_state(3.0), tmp_path / "latest")
    assert any("restored" in x for x in said), said
    assert not any(".replaced-" in n for n in os.listdir(tmp_path))


def test_a_crash_between_the_two_renames_is_recovered_by_the_next_save(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    save(_state(1.0), path)
    os.makedirs(path / "tokenizer")
    (path / "config.json").write_text("{}")
    with monkeypatch.context() as m:
        _kill_at_rename(m, 2)
        with pytest.raises(_Killed):
            save(_state(2.0), path)
    _as_if_dead(tmp_path)
    save(_state(3.0), tmp_path / "other")  # another series ("latest" and "other" differ)
    assert not os.path.exists(path), "a save of another series does not touch it"
    said = save(_state(3.0), path)
    assert any("restored" in s for s in said), said
    assert os.listdir(tmp_path / "latest" / "tokenizer") == [] and (path / "config.json").read_text() == "{}"
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".shardwise")) == ["latest", "other"]
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 3.0))


def test_replacing_a_checkpoint_keeps_user_files_inside_it(tmp_path):
    path = tmp_path / "model"
    save(_state(1.0), path)
    os.makedirs(path / "tokenizer")
    (path / "tokenizer" / "vocab.txt").write_text("a b c")
    (path / "config.json").write_text('{"dim": 3}')
    save(_state(2.0), path)
    assert (path / "config.json").read_text() == '{"dim": 3}' and (path / "tokenizer" / "vocab.txt").exists()
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 2.0))
    assert sorted(os.listdir(tmp_path)) == [RECORD_FILE, "model"]


def test_keep_last_rotates_only_what_this_series_wrote(tmp_path):
    other_job = tmp_path / "other"
    for i in range(3):  # another job's checkpoints, same naming, written into another folder and moved here
        save(_state(9.0), other_job / f"step-{i}")
    for i in range(3):
        os.rename(other_job / f"step-{i}", tmp_path / f"step-{100 + i}")
    save(_state(5.0), tmp_path / "best-model")  # a checkpoint of another series
    os.makedirs(tmp_path / "notes")
    for step in range(1, 5):
        said = save(_state(float(step), step), tmp_path / f"step-{step}", keep_last=2)
        if step == 2:
            os.symlink(tmp_path / "step-2", tmp_path / "latest")
            (tmp_path / "step-2" / "config.json").write_text("{}")
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert names == ["best-model", "latest", "notes", "other", "step-100", "step-101", "step-102", "step-2",
                     "step-3", "step-4"], names
    assert os.listdir(tmp_path / "step-2") == ["config.json"], "only the checkpoint's own files were removed"
    assert any("step-2" in s and "config.json" in s for s in said), said
    assert os.path.islink(tmp_path / "latest")
    record = json.loads((tmp_path / RECORD_FILE).read_text())
    assert [c["name"] for c in record["series"]["step-"]["checkpoints"]] == ["step-4", "step-3"]
    for i in range(3):
        assert _loaded(tmp_path / f"step-{100 + i}")["w"][0, 0] == 9.0


def test_rotation_leaves_a_recorded_name_alone_once_it_is_something_else(tmp_path):
    save(_state(1.0), tmp_path / "step-1", keep_last=1)
    os.rename(tmp_path / "step-1", tmp_path / "moved")
    save(_state(0.5), tmp_path / "step-1", series="someone-else")  # now another series' checkpoint
    said = save(_state(2.0), tmp_path / "step-2", keep_last=1)
    assert any("left" in s and "step-1" in s for s in said), said
    assert os.path.exists(tmp_path / "step-1") and os.path.exists(tmp_path / "moved")


def test_a_second_save_leaves_an_async_save_in_progress_alone(tmp_path):
    from shardwise.checkpoint import async_save

    handle = async_save(_state(1.0), tmp_path / "step-1")
    save(_state(2.0), tmp_path / "step-2", keep_last=5)
    handle.wait()
    assert _loaded(tmp_path / "step-1")["w"][0, 0] == 1.0 and _loaded(tmp_path / "step-2")["w"][0, 0] == 2.0


# -- merge and reshard: never onto their source or an existing path without --replace -----------

def test_merge_and_reshard_refuse_their_source_and_existing_paths(tmp_path, capsys):
    src, other = tmp_path / "src", tmp_path / "other"
    save(_state(1.0), src)
    save(_state(2.0), other)
    for argv in (["merge", str(src), str(src)], ["merge", str(src), str(other)],
                 ["reshard", str(src), str(src), "--world-size", "2"],
                 ["reshard", str(src), str(other), "--world-size", "2"],
                 ["merge", str(src), str(src / "inside")], ["merge", str(other / "rank-00000.safetensors"), "x"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
    assert _loaded(src)["w"][0, 0] == 1.0 and _loaded(other)["w"][0, 0] == 2.0
    assert main(["merge", str(src), str(src), "--replace"]) == 1, "never onto the source, even with --replace"
    reshard_checkpoint(src, other, 2, replace=True)
    assert _loaded(other)["w"][0, 0] == 1.0
    merge_checkpoint(src, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="already exists"):
        merge_checkpoint(src, tmp_path / "hf")
    merge_checkpoint(other, tmp_path / "hf", replace=True)
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    with pytest.raises(CheckpointError, match="not a merge output"):
        merge_checkpoint(src, other, replace=True)
    assert not [n for n in os.listdir(tmp_path) if "incomplete" in n or "replaced" in n]


# -- load(strict=False) that matches nothing ----------------------------------------------------

def test_non_strict_load_that_matches_no_key_is_an_error(tmp_path):
    save({"model": {"w": torch.ones(2)}, "step": 3}, tmp_path / "c")
    target = {"w": torch.zeros(2)}  # the "model/" level forgotten
    with pytest.raises(CheckpointError, match="no key of the target"):
        load(target, tmp_path / "c", strict=False)
    target = {"model": {"w": torch.zeros(2), "extra": torch.zeros(1)}}
    load(target, tmp_path / "c", strict=False)  # some keys match: fine
    assert torch.equal(target["model"]["w"], torch.ones(2))


# -- an async save never waited for -------------------------------------------------------------

_NEVER_WAITED = """
import torch
from shardwise.checkpoint import async_save
handle = async_save({"w": torch.ones(1000, 100)}, PATH)
"""


def test_async_save_never_waited_for_warns_commits_nothing_and_leaves_nothing(tmp_path):
    path = tmp_path / "step-1"
    done = subprocess.run([sys.executable, "-c", _NEVER_WAITED.replace("PATH", repr(str(path)))], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "was never waited for" in done.stderr and "NOT committed" in done.stderr, done.stderr
    assert not os.path.exists(path)
    assert [n for n in os.listdir(tmp_path) if "incomplete" in n] == [], os.listdir(tmp_path)


# -- Hugging Face folders may be symlinks into a download cache; checkpoint files may not ------

def test_hugging_face_folder_of_symlinks_loads_but_a_symlinked_checkpoint_file_is_refused(tmp_path):
    from shardwise.checkpoint import load_safetensors

    save(_state(4.0), tmp_path / "ck")
    merge_checkpoint(tmp_path / "ck", tmp_path / "blobs")
    os.makedirs(tmp_path / "snapshot")
    for name in os.listdir(tmp_path / "blobs"):  # the layout of a hub cache snapshot
        os.symlink(tmp_path / "blobs" / name, tmp_path / "snapshot" / name)
    target = {"w": torch.zeros(4, 3)}
    load_safetensors(target, tmp_path / "snapshot")
    assert torch.equal(target["w"], torch.full((4, 3), 4.0))
    data = tmp_path / "ck" / "rank-00000.safetensors"
    os.rename(data, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", data)
    with pytest.raises(CheckpointError, match="symbolic link"):
        load(_state(0.0, 0), tmp_path / "ck")


def test_a_permission_error_is_named_as_such(tmp_path, monkeypatch, capsys):
    """(Tests run as root, where permissions do not stop reads: the error is injected.)"""
    import shardwise.checkpoint._storage._posix as posix

    save(_state(1.0), tmp_path / "ck")
    real = os.open

    def denied(file, flags, *a, **k):
        if str(file).endswith("index.json"):
            raise PermissionError(13, "Permission denied", file)
        return real(file, flags, *a, **k)

    monkeypatch.setattr(posix.os, "open", denied)
    assert main(["merge", str(tmp_path / "ck"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "permission denied" in err and "index.json" in err and "No such file" not in err, err


def test_keep_last_keeps_the_new_checkpoint_when_the_clock_stepped_back(tmp_path, monkeypatch):
    import time

    save(_state(1.0), tmp_path / "step-1", keep_last=1)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 3600 * 10**9)  # an hour back (NTP step)
    said = save(_state(2.0), tmp_path / "step-2", keep_last=1)
    assert os.path.exists(tmp_path / "step-2") and not os.path.exists(tmp_path / "step-1"), said
    assert _loaded(tmp_path / "step-2")["w"][0, 0] == 2.0
    record = json.loads((tmp_path / RECORD_FILE).read_text())
    assert [c["name"] for c in record["series"]["step-"]["checkpoints"]] == ["step-2"]


def test_rotation_orders_records_without_seq_by_their_stored_order(tmp_path):
    """Records written before ``seq`` existed (newest first) still rotate oldest first."""
    for step in (1, 2):
        save(_state(float(step)), tmp_path / f"step-{step}")
    file = tmp_path / RECORD_FILE
    record = json.loads(file.read_text())
    for c in record["series"]["step-"]["checkpoints"]:
        del c["seq"]
        c["created_unix_ns"] = 0  # clocks give no order
    file.write_text(json.dumps(record))
    save(_state(3.0), tmp_path / "step-3", keep_last=2)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-2", "step-3"]


@pytest.mark.parametrize("name", ["..", ".", ""])
def test_a_pending_entry_naming_the_folder_itself_is_ignored(tmp_path, name):
    """A damaged or hand-edited record must not make cleanup reach outside the folder."""
    from shardwise.checkpoint._series._commit import temp_dir_for
    from shardwise.checkpoint import PosixStorage

    folder = tmp_path / "ckpt"
    folder.mkdir()
    outside = temp_dir_for(PosixStorage(), os.path.join(folder, name), "t1")  # what that entry's temp dir would be
    os.makedirs(outside)
    (folder / RECORD_FILE).write_text(json.dumps({"format": "shardwise.series", "version": 1, "series": {
        "step-": {"checkpoints": [], "pending": [{"name": name, "token": "t1", "host": "elsewhere", "pid": 1}]}}}))
    save(_state(1.0), folder / "step-1")
    assert os.path.isdir(outside), f"{outside} was removed"
    assert _loaded(folder / "step-1")["w"][0, 0] == 1.0


def test_hidden_checkpoint_names_still_rotate(tmp_path):
    for step in (1, 2):
        save(_state(float(step)), tmp_path / f".step-{step}", keep_last=1)
    assert not os.path.exists(tmp_path / ".step-1") and _loaded(tmp_path / ".step-2")["w"][0, 0] == 2.0
