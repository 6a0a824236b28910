"""Where a save writes: `check_save_target` (the target checked before training, not
collective) and `prepare`, step 2 of [Note: the steps of a save] in ``_writer.py`` (collective:
rank 0 checks the target, cleans up the series and creates the temporary directory)."""

from __future__ import annotations

import os
import secrets
from typing import Any

from .._base import CheckpointError, broadcast_json
from .._series import abort_save, begin_save, check_target, temp_dir_for
from .._storage import Storage, storage_for

__all__ = ["check_save_target", "prepare"]


def check_save_target(path: str | os.PathLike, *, storage: Storage | None = None) -> None:
    """Raise `CheckpointError` (one line naming ``path`` and the fix) unless `save` could write
    a checkpoint at ``path`` now: it is missing, an empty folder or a shardwise checkpoint (not a
    user's folder, not a symbolic link, not under a file), and its folder can be created and
    written to (checked by creating and deleting a probe entry there). Not collective; nothing
    is left behind. A training script calls it before the first step, so that a bad ``--save``
    fails at once and not after hours of training."""
    storage, norm = storage_for(path, storage)
    check_target(storage, norm)
    parent = storage.parent(norm)
    probe = storage.join(parent, f".{storage.name(norm)}.probe-{secrets.token_hex(4)}")
    try:
        storage.mkdir(parent, parents=True)
        storage.write_atomic(probe, b"")
        storage.delete(probe)
    except OSError as e:
        raise CheckpointError(f"cannot save to {storage.url(norm)}: {storage.url(parent)} is not writable "
                              f"({e.strerror or type(e).__name__}); choose a folder this job can write to") from None


def prepare(storage: Storage, path: str, series: str, rank: int) -> dict:
    """Step 2 of [Note: the steps of a save] (collective): rank 0 checks the target, cleans up
    the series and creates the temporary directory; every rank gets ``{"token", "said"}``."""
    token = secrets.token_hex(4)
    setup: dict[str, Any] = {"token": token, "error": None, "said": []}
    if rank == 0:
        try:
            current = check_target(storage, path)
            setup["said"] = begin_save(storage, path, series, token, current)
            storage.mkdir(temp_dir_for(storage, path, token), parents=not storage.atomic_rename)
        except Exception as e:
            setup["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
            try:  # begin_save may have recorded it: forget it (else the next save of the series does)
                abort_save(storage, path, series, token)
            except Exception:
                pass
    setup = broadcast_json(setup, src=0)
    if setup["error"] is not None:
        raise CheckpointError(f"saving checkpoint {storage.url(path)} failed on rank 0: {setup['error']}")
    return setup
