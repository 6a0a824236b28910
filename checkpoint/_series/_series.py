"""The series record: which checkpoints (and which unfinished saves) a series of saves owns.

[Note: series]
Saves of one run into one folder form a *series* (``save(..., series=...)``; by default the
name without its trailing digits: ``ckpt/step-100``, ``ckpt/step-200`` are the series ``step-``).
Each series is recorded in the folder's ``.shardwise-series.json`` (under the storage's lock of
the folder, written atomically, deleted when empty): its committed checkpoints with their
``save_id``, and its unfinished saves (``pending``: name and token, so their
``.incomplete-<token>``/``.replaced-<token>`` directories are known).

Only what is recorded is ever removed, never something guessed from a name:

* at the start of a save, each pending save of the series whose process is gone (or ran on
  another host, or is this process no longer saving) is cleaned up: its ``.incomplete-``
  directory deleted, a ``.replaced-`` copy renamed back when its checkpoint is missing or else
  finished ([Note: atomic commit] in ``_commit.py``), and a save that had committed before the
  kill is recorded as committed. A pending save that may still run is left alone;
* ``keep_last=N`` deletes the recorded checkpoints beyond the ``N`` newest, each only if it
  still is the one the series wrote (a real directory whose index has the recorded
  ``save_id``), and only its own files (``_commit.delete_own_files``). Other series, other
  folders, symbolic links and anything written before the record are never touched.

[Note: deleting through the record]
A checkpoint to rotate away moves in the record from ``checkpoints`` to ``deleting`` (with its
own files' names) *before* any file is deleted, and leaves it only once gone: a kill in between
never loses track; every later save or rotation of the series finishes it. A failed deletion is
reported ("could not remove") and stays listed. Under a pointer commit ([Note: commit by a
pointer] in ``_commit.py``) what a save supersedes or rotates away is listed with ``"old"`` and
deleted by the next save of the series, never the same one: the readers' grace. A version
folder that a pointer names again is never deleted.

[Note: rotation order]
"Newest" is commit order, not clock: each recorded checkpoint carries ``seq``, one more than the
largest of its series (``created_unix_ns`` is for people only: a clock stepped back must not
make the newest checkpoint look oldest). The checkpoint just committed is never rotated away.
Records without ``seq`` keep their stored order and rank below every numbered one.

Every function returns sentences saying what it removed or restored; ``save`` logs and returns them.
"""

from __future__ import annotations

import json
import re
import threading

from ._commit import delete_own_files, index_of, recover_replaced, remove_temp, superseded, temp_dir_for
from .._base import CheckpointError, parse_json_strict
from .._format import DCP_MARKER, INDEX_FILE, VERSION_MARK, own_names, plain_file_name, pointer_at
from .._storage import Storage

__all__ = ["RECORD_FILE", "default_series", "begin_save", "finish_save", "abort_save", "saving"]

RECORD_FILE = ".shardwise-series.json"
_MAX_RECORD_BYTES = 64 << 20

_active: set[str] = set()  # tokens of the saves this process is running (begun, not finished or aborted)
_active_guard = threading.Lock()


def saving(token: str, on: bool) -> None:
    """Mark the save ``token`` of this process as running (``on``) or over."""
    with _active_guard:
        (_active.add if on else _active.discard)(token)


def default_series(name: str) -> str:
    """The checkpoint's name without trailing digits (``step-100`` -> ``step-``)."""
    return re.sub(r"\d+$", "", name)


def _load(storage: Storage, parent: str) -> dict:
    file = storage.join(parent, RECORD_FILE)
    try:
        try:
            data = storage.read_small(file, _MAX_RECORD_BYTES)  # refuses what is not a regular file
        except (OSError, CheckpointError):
            if storage.kind(file) == "missing":
                return {"format": "shardwise.series", "version": 1, "series": {}}
            raise ValueError("not a regular file") from None
        raw = parse_json_strict(data.decode("utf-8"))
        if not isinstance(raw, dict) or not isinstance(raw.get("series"), dict):
            raise ValueError("not a series record")
    except (OSError, ValueError, RecursionError, UnicodeDecodeError, CheckpointError):
        raise CheckpointError(f"{storage.url(file)} is damaged (not a shardwise series record); move it away to start "
                              "a new record (checkpoints it listed will then never be rotated)") from None
    return raw


def _store(storage: Storage, parent: str, record: dict) -> None:
    record["series"] = {k: v for k, v in record["series"].items()
                        if isinstance(v, dict) and (v.get("checkpoints") or v.get("pending") or v.get("deleting"))}
    file = storage.join(parent, RECORD_FILE)
    if record["series"]:
        storage.write_atomic(file, (json.dumps(record, indent=1) + "\n").encode())
    elif storage.kind(file) != "missing":
        storage.delete(file)


def _entry(record: dict, series: str) -> dict:
    s = record["series"].setdefault(series, {})
    for k in ("checkpoints", "pending", "deleting"):
        if not isinstance(s.get(k), list):
            s[k] = []
    return s


def _entry_name(name: object) -> bool:
    """Whether a recorded ``name`` names an entry of the folder: a plain file name
    (``plain_file_name``), hidden ones (``.step-1``, which ``save`` accepts) included; never
    ``""``, ``.`` or ``..``, which would make cleanup and rotation reach the folder itself or
    the one above it."""
    return plain_file_name(name) or (isinstance(name, str) and name.startswith(".") and plain_file_name(name[1:]))


def _running(storage: Storage, p: dict) -> bool:
    """Whether the save of pending entry ``p`` may still be running: this process's own saves
    only while it runs them; another process's while the storage says it is alive (POSIX: the
    same host and a live pid). Saves of other hosts are taken as finished: one series is saved
    by one job at a time."""
    me = storage.holder()
    if all(p.get(k) == v for k, v in me.items()):
        with _active_guard:
            return p.get("token") in _active
    return storage.holder_alive(p)


def _seq(c: dict) -> int:
    """A record's place in its series' save order (see [Note: rotation order]); -1 for records
    written before records were numbered."""
    n = c.get("seq")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else -1


def _clean_pending(storage: Storage, parent: str, entry: dict) -> list[str]:
    said, still = [], []
    for p in entry["pending"]:
        name, token = p.get("name") if isinstance(p, dict) else None, p.get("token") if isinstance(p, dict) else None
        if not _entry_name(name) or not isinstance(token, str) or "/" in token or not token:
            continue
        if _running(storage, p):
            still.append(p)
            continue
        assert isinstance(name, str)
        path = storage.join(parent, name)
        tmp = temp_dir_for(storage, path, token)
        if remove_temp(storage, tmp):
            said.append(f"removed {storage.url(tmp)}, left by a save that did not finish")
        done = recover_replaced(storage, path, token)
        if done:
            said.append(done)
        raw = index_of(storage, path)
        if raw is not None and raw.get("save_id") == token and isinstance(p.get("old"), list):
            entry["deleting"].append({"name": name, "save_id": token, "old": p["old"]})
        if raw is not None and raw.get("save_id") == token and not any(
                isinstance(c, dict) and c.get("name") == name and c.get("save_id") == token for c in entry["checkpoints"]):
            seq = max((_seq(c) for c in entry["checkpoints"] if isinstance(c, dict)), default=-1) + 1
            created = raw.get("created_unix_ns")
            entry["checkpoints"] = [c for c in entry["checkpoints"] if not (isinstance(c, dict) and c.get("name") == name)]
            entry["checkpoints"].insert(0, {"name": name, "save_id": token, "seq": seq,
                                            "created_unix_ns": created if isinstance(created, int) else None})
            said.append(f"recorded {storage.url(path)}, committed by a save that stopped before recording it")
    entry["pending"] = still
    return said


def _delete_listed(storage: Storage, parent: str, entry: dict) -> list[str]:
    """Finish the deletions listed in ``entry["deleting"]`` ([Note: deleting through the record])."""
    said, still = [], []
    for d in entry["deleting"]:
        name = d.get("name") if isinstance(d, dict) else None
        if isinstance(d.get("old"), list) and isinstance(name, str) and _entry_name(name):
            try:
                said += _delete_old(storage, storage.join(parent, name), d["old"])
            except OSError as e:
                still.append(d)
                said.append(f"could not remove what a save superseded in {storage.url(storage.join(parent, name))} "
                            f"({e.strerror or type(e).__name__}); retried at the next save")
            continue
        files = d.get("files") if isinstance(d, dict) else None
        if not _entry_name(name) or not isinstance(files, list) or not isinstance(name, str):
            continue
        full = storage.join(parent, name)
        raw = index_of(storage, full)
        kind = storage.kind(full) if raw is None else "dir"
        if kind == "missing":
            said.append(f"removed {storage.url(full)}")
            continue
        if kind != "dir" or (raw is not None and raw.get("save_id") != d.get("save_id")):
            said.append(f"left {storage.url(full)} alone: it is no longer the checkpoint this series wrote there")
            continue
        try:
            left = delete_own_files(storage, full, names={f for f in files if plain_file_name(f) or f == DCP_MARKER})
        except OSError as e:
            still.append(d)
            said.append(f"could not remove {storage.url(full)} ({e.strerror or type(e).__name__}); it stays in the "
                        "series record and is retried at the next save")
            continue
        left = [n for n in left if not n.startswith(VERSION_MARK)]  # listed with "old": the next save's
        said.append(f"removed the checkpoint files of {storage.url(full)} (kept the other entries there: {left})"
                    if left else f"removed {storage.url(full)}")
    entry["deleting"] = still
    return said


def _delete_old(storage: Storage, path: str, old: list) -> list[str]:
    """Delete the superseded entries ``old`` of checkpoint ``path`` ([Note: commit by a pointer]
    in ``_commit.py``): version folders and files of an index written in place, never one that
    the index there now names."""
    raw = index_of(storage, path)
    keep = {pointer_at(raw)} if pointer_at(raw) else own_names(raw) if raw else set()
    gone = []
    for n in old:
        if not isinstance(n, str) or n in keep or not _entry_name(n) or n == INDEX_FILE:
            continue
        full = storage.join(path, n)
        if n.startswith(VERSION_MARK):
            storage.rmtree(full)
        elif storage.kind(full) == "file":
            storage.delete(full)
        gone.append(n)
    if raw is None and not storage.list(path):
        storage.rmdir(path)  # rotated away: the folder goes with its last version
    return [f"removed {gone} of {storage.url(path)}, superseded by a later save"] if gone else []


def begin_save(storage: Storage, path: str, series: str, token: str, current: dict | None = None) -> list[str]:
    """Rank 0, before creating the temporary directory: clean up the series' unfinished saves
    and deletions, then record this one as pending (where it commits by a pointer, with what it
    will supersede of ``current``, the index at ``path`` now)."""
    parent = storage.parent(path)
    storage.mkdir(parent, parents=True)
    with storage.lock(parent):
        record = _load(storage, parent)
        entry = _entry(record, series)
        said = _clean_pending(storage, parent, entry)
        said += _delete_listed(storage, parent, entry)
        mine = {"name": storage.name(path), "token": token, **storage.holder()}
        if not storage.atomic_rename and current is not None:
            mine["old"] = superseded(current)
        entry["pending"].append(mine)
        _store(storage, parent, record)
    saving(token, True)
    return said


def abort_save(storage: Storage, path: str, series: str, token: str) -> None:
    """Rank 0, after a failed save whose temporary directory was deleted: forget it (if the
    record cannot be written, a full disk, the entry stays and the next save cleans it up: this
    process no longer counts it as running)."""
    saving(token, False)
    parent = storage.parent(path)
    with storage.lock(parent):
        record = _load(storage, parent)
        entry = _entry(record, series)
        entry["pending"] = [p for p in entry["pending"] if not (isinstance(p, dict) and p.get("token") == token)]
        _store(storage, parent, record)




def finish_save(storage: Storage, path: str, series: str, token: str, created: int | None,
                keep_last: int | None) -> list[str]:
    """Rank 0, after the commit: record the checkpoint, then rotate (``keep_last``) through the
    record ([Note: deleting through the record])."""
    parent, name = storage.parent(path), storage.name(path)
    said = []
    saving(token, False)
    with storage.lock(parent):
        record = _load(storage, parent)
        entry = _entry(record, series)
        later = [{"name": name, "save_id": token, "old": p["old"]} for p in entry["pending"]
                 if isinstance(p, dict) and p.get("token") == token and isinstance(p.get("old"), list) and p["old"]]
        entry["pending"] = [p for p in entry["pending"] if not (isinstance(p, dict) and p.get("token") == token)]
        older = [c for c in entry["checkpoints"] if isinstance(c, dict) and c.get("name") != name]
        older.sort(key=_seq, reverse=True)  # stable: unnumbered (older) records keep their order, last
        seq = max((_seq(c) for c in older), default=-1) + 1
        # the checkpoint just committed is the newest whatever the clocks say: never doomed
        kept = [{"name": name, "save_id": token, "created_unix_ns": created, "seq": seq}, *older]
        if keep_last is not None:
            doomed, kept = kept[max(keep_last, 1):], kept[:max(keep_last, 1)]
            for c in doomed:
                cname = c.get("name")
                full = storage.join(parent, cname) if isinstance(cname, str) and _entry_name(cname) else None
                raw = index_of(storage, full) if full is not None else None
                if full is None or (raw is None and storage.kind(full) == "missing"):
                    said.append(f"forgot {cname!r} of the series record (already gone)")
                    continue
                if raw is None or raw.get("save_id") != c.get("save_id"):
                    said.append(f"left {storage.url(full)} alone: it is no longer the checkpoint this series wrote "
                                "there")
                    continue
                at = pointer_at(raw)
                entry["deleting"].append({"name": cname, "save_id": c.get("save_id"),
                                          "files": [INDEX_FILE] if at else sorted(own_names(raw))})
                if at:  # its version folder: readers that followed the pointer still read it
                    later.append({"name": cname, "save_id": c.get("save_id"), "old": [at]})
        entry["checkpoints"] = kept
        now = entry["deleting"]
        entry["deleting"] = now + later  # ``later``: deleted by the next save ([Note: commit by a pointer])
        _store(storage, parent, record)  # the doomed are listed as deleting before any file goes
        if now:
            entry["deleting"] = now
            said += _delete_listed(storage, parent, entry)
            entry["deleting"] += later
            storage.fsync_dir(parent)
            _store(storage, parent, record)
    return said
