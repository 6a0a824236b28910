"""Atomic commit of a checkpoint directory, replacing one safely, and deleting only our own files.

[Note: atomic commit]
A save writes everything into a sibling temporary directory ``.<name>.incomplete-<token>``:
first the data files (each fsynced by the rank that wrote it), then ``index.json`` (written to
``index.json.tmp``, fsynced, renamed), then the directory itself is fsynced and renamed to
``<name>``, and the parent directory is fsynced. ``rename`` is atomic, so ``<name>`` either
does not exist or is complete; a job killed at any point leaves earlier checkpoints untouched
and at worst a directory whose name says ``incomplete`` and which has no ``index.json``
(every reader refuses it with a message saying so). ``tests/test_checkpoint_commit_order.py``
checks this order of calls.

If ``<name>`` already is a checkpoint it is replaced: it is renamed away to
``.<name>.replaced-<token>`` first, the new one is renamed into place, then the files of the
old one that the checkpoint format did not write (a ``config.json``, a ``tokenizer/`` folder a
user put there) are moved into the new one, and only then the rest of the old one is deleted.
A crash between the two renames leaves ``<name>`` missing and the intact old checkpoint in
``.<name>.replaced-<token>``: `recover_replaced` (run by the next ``load`` of ``<name>`` and,
through the series record, by the next save) renames it back. A ``<name>`` that exists but is
not a checkpoint (and not an empty directory), or is a symbolic link, is never touched.

A checkpoint's *own files* (`own_files`) are ``index.json`` and the data files its index
lists; `delete_own_files` deletes those (index first, so the directory stops being a
checkpoint at once) and the directory only if nothing else is left in it.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable

from ._errors import CheckpointError
from ._format import FORMAT_NAME, INCOMPLETE_MARK, INDEX_FILE, plain_file_name
from ._json_strict import parse_json_strict

__all__ = ["temp_dir_for", "replaced_dir_for", "fsync_dir", "check_target", "commit", "own_files", "delete_own_files",
           "recover_replaced", "is_checkpoint"]

REPLACED_MARK = ".replaced-"


def temp_dir_for(path: str, token: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{INCOMPLETE_MARK}{token}")


def replaced_dir_for(path: str, token: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{REPLACED_MARK}{token}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _index_of(path: str) -> dict | None:
    """The parsed index of the checkpoint directory ``path`` (a real directory, not a symlink,
    holding a regular ``index.json`` of this format), or None."""
    file = os.path.join(path, INDEX_FILE)
    if os.path.islink(path) or not os.path.isdir(path) or os.path.islink(file) or not os.path.isfile(file):
        return None
    try:
        with open(file, "rb") as f:
            raw = parse_json_strict(f.read(1 << 30))
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT_NAME else None


def is_checkpoint(path: str) -> bool:
    return _index_of(path) is not None


def own_files(path: str) -> set[str]:
    """The names inside checkpoint ``path`` that the format wrote: the index (and its temporary
    name) and the data files it lists."""
    names = {INDEX_FILE, INDEX_FILE + ".tmp"}
    raw = _index_of(path)
    files = raw.get("files") if raw else None
    if isinstance(files, dict):
        names |= {n for n in files if plain_file_name(n)}
    return names


def check_target(path: str, replaceable: Callable[[str], bool] | None = None) -> None:
    """Raise if ``path`` exists and is neither a checkpoint (``replaceable``, default
    `is_checkpoint`) nor an empty directory."""
    replaceable = replaceable or is_checkpoint
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link; refusing to replace it. Save to the directory it points to, "
                              "or to a new path")
    if os.path.isdir(path) and (replaceable(path) or not os.listdir(path)):
        return
    raise CheckpointError(
        f"{path} exists and is not a shardwise checkpoint; refusing to replace it. Save to a new path or "
        "remove it first"
    )


def _move_user_files(old: str, new: str, own: Callable[[str], set[str]]) -> list[str]:
    """Move what the format did not write from checkpoint ``old`` into ``new``; returns names
    that could not be moved (a name the new checkpoint uses itself)."""
    ours, left = own(old), []
    for name in sorted(os.listdir(old)):
        if name in ours:
            continue
        if os.path.lexists(os.path.join(new, name)):
            left.append(name)
        else:
            os.rename(os.path.join(old, name), os.path.join(new, name))
    return left


def delete_own_files(path: str, own: Callable[[str], set[str]] | None = None) -> list[str]:
    """Delete checkpoint ``path``'s own files (``own``, default `own_files`; the index first) and
    the directory when nothing else is in it; returns the names of other entries left in place."""
    ours = (own or own_files)(path)
    for name in [n for n in ours if n == INDEX_FILE] + sorted(ours - {INDEX_FILE}):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass  # already gone, or not a file: then it is listed as left in place
    left = sorted(os.listdir(path))
    if not left:
        os.rmdir(path)
    return left


def _finish_replace(old: str, path: str, own: Callable[[str], set[str]] | None = None) -> list[str]:
    """After the swap: move the user's files from ``old`` into ``path``, delete the rest of
    ``old`` (only if nothing but our files is left). Returns what stayed in ``old``."""
    own = own or own_files
    left = _move_user_files(old, path, own)
    if left:
        return left
    return delete_own_files(old, own)


def commit(tmp: str, path: str, token: str, replaceable: Callable[[str], bool] | None = None,
           own: Callable[[str], set[str]] | None = None) -> list[str]:
    """Move the finished ``tmp`` directory to ``path`` (see [Note: atomic commit]). Returns
    entries of a replaced checkpoint that could not be moved over (left in its
    ``.replaced-`` directory)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    fsync_dir(tmp)
    check_target(path, replaceable)
    old = None
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    elif os.path.isdir(path):
        old = replaced_dir_for(path, token)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(parent)
    if old is None:
        return []
    left = _finish_replace(old, path, own)
    fsync_dir(parent)
    return [os.path.join(old, n) for n in left]


def recover_replaced(path: str, token: str | None = None) -> str | None:
    """Repair a replace that stopped between its two renames or before deleting the old copy.

    If ``<name>`` is missing and a ``.<name>.replaced-<token>`` checkpoint exists (the newest,
    when ``token`` is None), rename it back to ``<name>``. If ``<name>`` exists and ``token``
    is given, finish that replace (move user files over, delete the old copy). Returns a
    sentence saying what was done, or None when there was nothing to do.
    """
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    pattern = f".{glob.escape(name)}{REPLACED_MARK}{token if token else '*'}"
    found = [p for p in glob.glob(os.path.join(glob.escape(parent), pattern)) if is_checkpoint(p)]
    if not found:
        return None
    if not os.path.lexists(path):
        newest = max(found, key=lambda p: int((_index_of(p) or {}).get("created_unix_ns") or 0))
        os.rename(newest, path)
        fsync_dir(parent)
        return f"restored {path} from {newest}, left there by a replace that did not finish"
    if token is None or not is_checkpoint(path):
        return None
    left = _finish_replace(found[0], path)
    fsync_dir(parent)
    return f"finished replacing {path}: removed the old copy {found[0]}" + (f" (kept {left})" if left else "")


def remove_temp(tmp: str) -> bool:
    """Delete a temporary ``.incomplete-`` directory this process created; True if it existed."""
    if INCOMPLETE_MARK not in os.path.basename(tmp) or os.path.islink(tmp) or not os.path.isdir(tmp):
        return False
    shutil.rmtree(tmp, ignore_errors=True)
    return True
