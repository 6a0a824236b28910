"""Atomic commit of a checkpoint directory, and ``keep_last`` rotation.

[Note: atomic commit]
A save writes everything into a sibling temporary directory ``.<name>.incomplete-<token>``:
first the data files (each fsynced by the rank that wrote it), then ``index.json`` (fsynced),
then the directory itself is fsynced and renamed to ``<name>``, and the parent directory is
fsynced. ``rename`` is atomic, so ``<name>`` either does not exist or is complete; a job
killed at any point leaves earlier checkpoints untouched and at worst a directory whose name
says ``incomplete`` and which has no ``index.json`` (every reader refuses it with a message
saying so).

If ``<name>`` already is a checkpoint it is replaced: it is renamed away to
``.<name>.replaced-<token>`` first and deleted only after the new one is in place, so a crash
in between leaves both. A ``<name>`` that exists but is not a checkpoint (and not empty) is
never touched.

Rotation (``keep_last=N``) considers the complete checkpoints next to ``<name>`` (siblings with
a shardwise ``index.json``), newest first by the time their index records, and deletes all but
the ``N`` newest, never the one just written. A deleted checkpoint is first renamed to
``.<name>.deleting-<token>`` so it stops looking complete before its files go.
"""

from __future__ import annotations

import json
import os
import shutil

from ._comm import CheckpointError
from ._format import FORMAT_NAME, INCOMPLETE_MARK, INDEX_FILE

__all__ = ["temp_dir_for", "fsync_dir", "commit", "rotate"]


def temp_dir_for(path: str, token: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{INCOMPLETE_MARK}{token}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_checkpoint(path: str) -> bool:
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            return json.load(f).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def check_target(path: str) -> None:
    """Raise if ``path`` exists and is neither a checkpoint nor an empty directory."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and (_is_checkpoint(path) or not os.listdir(path)):
        return
    raise CheckpointError(
        f"{path} exists and is not a shardwise checkpoint; refusing to replace it. Save to a new path or "
        "remove it first"
    )


def commit(tmp: str, path: str, token: str) -> None:
    """Move the finished ``tmp`` directory to ``path`` (see [Note: atomic commit])."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_dir(tmp)
    check_target(path)
    old = None
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    elif os.path.isdir(path):
        old = os.path.join(parent, f".{os.path.basename(path)}.replaced-{token}")
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _created(path: str) -> int:
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            return int(json.load(f).get("created_unix_ns") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def rotate(path: str, keep_last: int, token: str) -> list[str]:
    """Delete all but the ``keep_last`` newest checkpoints next to ``path``; return those deleted."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    siblings = []
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if name.startswith(".") or not os.path.isdir(full) or not _is_checkpoint(full):
            continue
        siblings.append((_created(full), name, full))
    siblings.sort(reverse=True)
    doomed = [full for _, _, full in siblings[keep_last:] if full != path]
    for full in doomed:
        trash = os.path.join(parent, f".{os.path.basename(full)}.deleting-{token}")
        os.rename(full, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        fsync_dir(parent)
    return doomed
