"""`latest_checkpoint`: the newest complete checkpoint of a series, read from its record.

A resuming job asks the folder's series record ([Note: series] in ``_series.py``) instead of
guessing from names or modification times: the record lists only committed checkpoints, in
commit order (``seq``), so a save that is still being written (an ``async_save`` in flight, a
process killed mid-write: its ``.incomplete-`` directory and ``pending`` entry) is never
returned. Each candidate is checked to still be the checkpoint the series wrote (a directory
whose index carries the recorded ``save_id``); one that is gone or replaced by hand is skipped.
"""

from __future__ import annotations

import os

from ._commit import index_of
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
    for c in ordered:
        name = c.get("name")
        if not isinstance(name, str) or not _entry_name(name):
            continue
        path = storage.join(parent, name)
        raw = index_of(storage, path)
        if raw is not None and raw.get("save_id") == c.get("save_id"):
            return storage.url(path)
    return None
