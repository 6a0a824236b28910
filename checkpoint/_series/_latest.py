"""`latest_checkpoint`: the newest complete checkpoint of a series, read from its record.

The folder's series record ([Note: series] in ``_series.py``) lists only committed checkpoints
in commit order, so a save still being written (or killed mid-write) is never returned. Each
candidate must still be the checkpoint the series wrote (its index carries the recorded
``save_id``); one gone or replaced by hand is skipped. A checkpoint whose replace stopped half
way is still the committed one: its path is returned and a load reads the ``.replaced-`` copy
(`stand_in` in ``_commit.py``). A pending save whose index is in place (killed after its commit)
is committed and returned first.
"""

from __future__ import annotations

import os

from ._commit import index_of, stand_in
from .._base import CheckpointError
from ._series import _entry_name, _load, _seq
from .._storage import Storage, storage_for

__all__ = ["latest_checkpoint"]


def latest_checkpoint(folder: str | os.PathLike, *, series: str | None = None,
                      storage: Storage | None = None) -> str | None:
    """The path (or URL) of the newest committed checkpoint of ``series`` in ``folder``, or
    None when it has none (a fresh folder: start from step 0). ``series`` may be left out when
    the folder's record holds one series (``step-`` for ``step-100``, ``step-200``, ...);
    `CheckpointError` names the series otherwise. Not collective: every rank reads the same
    record, or call it on rank 0 and broadcast."""
    storage, parent = storage_for(folder, storage)
    if storage.kind(parent) == "missing":
        return None
    record = _load(storage, parent)
    names = sorted(record["series"])
    if series is None:
        if len(names) > 1:
            raise CheckpointError(f"{storage.url(parent)} holds the series {names}; pass series= to choose one")
        if not names:
            return None
        series = names[0]
    entry = record["series"].get(series)
    checkpoints = entry.get("checkpoints") if isinstance(entry, dict) else None
    if not isinstance(checkpoints, list):
        return None
    ordered = sorted((c for c in checkpoints if isinstance(c, dict)), key=_seq, reverse=True)
    pending = entry.get("pending") if isinstance(entry.get("pending"), list) else []
    # a pending save whose index is in place passed its commit point (the record is updated just
    # after): the newest committed checkpoint, as the next save's cleanup will record it
    ordered = [{"name": p.get("name"), "save_id": p.get("token")} for p in reversed(pending) if isinstance(p, dict)
               ] + ordered
    for c in ordered:
        name = c.get("name")
        if not isinstance(name, str) or not _entry_name(name):
            continue
        path = storage.join(parent, name)
        raw = index_of(storage, path)
        if raw is None:  # a replace of it stopped half way: a load of ``path`` reads the intact old copy
            old = stand_in(storage, path)
            raw = index_of(storage, old) if old is not None else None
        if raw is not None and raw.get("save_id") == c.get("save_id"):
            return storage.url(path)
    return None
