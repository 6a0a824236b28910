"""The series record: which checkpoints (and which unfinished saves) a series of saves owns.

[Note: series]
Saves of one training run into one folder form a *series* (``save(..., series=...)``; by
default the checkpoint's name without its trailing digits, so ``ckpt/step-100``,
``ckpt/step-200`` are the series ``step-`` of ``ckpt/``). Each series is recorded in the
folder's ``.shardwise-series.json`` (updated under an exclusive ``flock`` of the folder, written
atomically, deleted when no series in it has anything left to record): the checkpoints it committed, each with the
``save_id`` its index carries, and the saves it started but has not finished (``pending``:
name and token, so their ``.incomplete-<token>``/``.replaced-<token>`` directories are known).

Only what is recorded is ever removed, never something guessed from a name:

* at the start of a save, every pending save of the same series whose process is gone (or ran
  on another host) is cleaned up: its ``.incomplete-`` directory deleted, a ``.replaced-``
  copy renamed back when its checkpoint is missing (a crash between the two renames of a
  replace) or else finished. A pending save of a live process on this host (an
  ``async_save`` not yet waited for) is left alone;
* ``keep_last=N`` deletes the series' recorded checkpoints beyond the ``N`` newest, each only
  if it still is the checkpoint the series wrote (a real directory whose index has the
  recorded ``save_id``), and of it only its own files (``_commit.delete_own_files``): files a
  user added stay, with the directory. Checkpoints of other series, other jobs' folders,
  symbolic links (``latest``) and anything written before the record existed are never
  touched.

[Note: rotation order]
"Newest" is the order of commits, not of clocks: each recorded checkpoint carries ``seq``, one
more than the largest of its series when it was committed (``created_unix_ns``, rank 0's wall
clock, is kept for people only: a clock stepped back, NTP or a host move, must not make the
checkpoint just written look oldest and be deleted). The checkpoint just committed is never
rotated away. Records written before ``seq`` existed keep their stored order (newest first)
and rank below every numbered one.

Every function returns sentences saying what it removed or restored; ``save`` logs them and
returns them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket

from ._commit import _index_of, delete_own_files, fsync_dir, recover_replaced, remove_temp, temp_dir_for
from ._errors import CheckpointError
from ._format import plain_file_name, write_json
from ._json_strict import parse_json_strict

__all__ = ["RECORD_FILE", "default_series", "begin_save", "finish_save", "abort_save"]

RECORD_FILE = ".shardwise-series.json"


def default_series(path: str) -> str:
    """The checkpoint's name without trailing digits (``step-100`` -> ``step-``)."""
    return re.sub(r"\d+$", "", os.path.basename(os.path.abspath(path)))


@contextlib.contextmanager
def _locked(parent: str):
    fd = os.open(parent, os.O_RDONLY)  # the folder itself is the lock: no lock file to leave behind
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load(parent: str) -> dict:
    file = os.path.join(parent, RECORD_FILE)
    if not os.path.lexists(file):
        return {"format": "shardwise.series", "version": 1, "series": {}}
    try:
        if os.path.islink(file):
            raise ValueError("a symbolic link")
        with open(file, "rb") as f:
            raw = parse_json_strict(f.read(64 << 20))
        if not isinstance(raw, dict) or not isinstance(raw.get("series"), dict):
            raise ValueError("not a series record")
    except (OSError, ValueError, RecursionError):
        raise CheckpointError(f"{file} is damaged (not a shardwise series record); move it away to start a new record "
                              "(checkpoints it listed will then never be rotated)") from None
    return raw


def _store(parent: str, record: dict) -> None:
    record["series"] = {k: v for k, v in record["series"].items() if v.get("checkpoints") or v.get("pending")}
    file = os.path.join(parent, RECORD_FILE)
    if record["series"]:
        write_json(file, json.dumps(record, indent=1) + "\n")
    elif os.path.lexists(file):
        os.unlink(file)


def _entry(record: dict, series: str) -> dict:
    s = record["series"].setdefault(series, {})
    s.setdefault("checkpoints", [])
    s.setdefault("pending", [])
    return s


def _entry_name(name) -> bool:
    """Whether a recorded ``name`` names an entry of the folder: a plain file name
    (``plain_file_name``), hidden ones (``.step-1``, which ``save`` accepts) included; never
    ``""``, ``.`` or ``..``, which would make cleanup and rotation reach the folder itself or
    the one above it."""
    return plain_file_name(name) or (isinstance(name, str) and name.startswith(".") and plain_file_name(name[1:]))


def _running(p: dict) -> bool:
    """Whether the save of pending entry ``p`` may still be running: its process is alive on this
    host (an ``async_save`` not yet waited for, another job). Saves of other hosts are taken as
    finished: one series is saved by one job at a time."""
    if p.get("host") != socket.gethostname() or not isinstance(p.get("pid"), int):
        return False
    try:
        os.kill(p["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _clean_pending(parent: str, entry: dict) -> list[str]:
    said, still = [], []
    for p in entry["pending"]:
        name, token = p.get("name"), p.get("token")
        if not _entry_name(name) or not isinstance(token, str) or "/" in token:
            continue
        if _running(p):
            still.append(p)
            continue
        path = os.path.join(parent, name)
        tmp = temp_dir_for(path, token)
        if remove_temp(tmp):
            said.append(f"removed {tmp}, left by a save that did not finish")
        done = recover_replaced(path, token)
        if done:
            said.append(done)
    entry["pending"] = still
    return said


def begin_save(path: str, series: str, token: str) -> list[str]:
    """Rank 0, before creating the temporary directory: clean up the series' unfinished saves,
    then record this one as pending."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with _locked(parent):
        record = _load(parent)
        entry = _entry(record, series)
        said = _clean_pending(parent, entry)
        entry["pending"].append({"name": os.path.basename(path), "token": token, "host": socket.gethostname(),
                                 "pid": os.getpid()})
        _store(parent, record)
    return said


def abort_save(path: str, series: str, token: str) -> None:
    """Rank 0, after a failed save whose temporary directory was deleted: forget it."""
    parent = os.path.dirname(os.path.abspath(path))
    with _locked(parent):
        record = _load(parent)
        entry = _entry(record, series)
        entry["pending"] = [p for p in entry["pending"] if p.get("token") != token]
        _store(parent, record)


def _ours(full: str, save_id: str) -> bool:
    raw = _index_of(full)
    return raw is not None and raw.get("save_id") == save_id


def _seq(c: dict) -> int:
    """A record's place in its series' save order (see [Note: rotation order]); -1 for records
    written before records were numbered."""
    n = c.get("seq")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else -1


def finish_save(path: str, series: str, token: str, created: int, keep_last: int | None) -> list[str]:
    """Rank 0, after the commit: record the checkpoint, then rotate (``keep_last``)."""
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    said = []
    with _locked(parent):
        record = _load(parent)
        entry = _entry(record, series)
        entry["pending"] = [p for p in entry["pending"] if p.get("token") != token]
        older = [c for c in entry["checkpoints"] if isinstance(c, dict) and c.get("name") != name]
        older.sort(key=_seq, reverse=True)  # stable: unnumbered (older) records keep their order, last
        seq = max((_seq(c) for c in older), default=-1) + 1
        # the checkpoint just committed is the newest whatever the clocks say: never doomed
        kept = [{"name": name, "save_id": token, "created_unix_ns": created, "seq": seq}, *older]
        if keep_last is not None:
            doomed, kept = kept[max(keep_last, 1):], kept[:max(keep_last, 1)]
            for c in doomed:
                said.append(_remove(parent, c))
            if doomed:
                fsync_dir(parent)
        entry["checkpoints"] = kept
        _store(parent, record)
    return said


def _remove(parent: str, c: dict) -> str:
    name = c.get("name")
    full = os.path.join(parent, name) if _entry_name(name) else None
    if full is None or not os.path.lexists(full):
        return f"forgot {name!r} of the series record (already gone)"
    if os.path.islink(full) or not _ours(full, c.get("save_id")):
        return f"left {full} alone: it is no longer the checkpoint this series wrote there"
    left = delete_own_files(full)
    if left:
        return f"removed the checkpoint files of {full} (kept the other entries there: {left})"
    return f"removed {full}"
