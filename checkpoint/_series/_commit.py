"""Atomic commit of a checkpoint directory, replacing one safely, and deleting only our own files.

[Note: atomic commit]
A save writes everything into a sibling ``.<name>.incomplete-<token>``: the data files (each
fsynced by its writer), then ``index.json`` (via ``index.json.tmp``, fsynced, renamed), then the
directory is fsynced and renamed to ``<name>`` and the parent fsynced. ``rename`` is atomic, so
``<name>`` is absent or complete; a killed job leaves at worst a directory named ``incomplete``
without ``index.json``, which every reader refuses. ``tests/test_checkpoint_commit_order.py``
checks this order. Every call goes through a storage ([Note: storage semantics] in
``_storage/_protocol.py``); where rename is not atomic: [Note: commit by a pointer].

An existing checkpoint ``<name>`` is replaced: renamed away to ``.<name>.replaced-<token>``, the
new one renamed into place, the old one's files the format did not write (a ``config.json``, a
``tokenizer/``) moved into the new one, then the rest of the old one deleted (index first). A
crash between the two renames leaves the intact old copy, which readers read in place
(`stand_in`, `latest_checkpoint`) and the next save of the series renames back
(`recover_replaced`). A crash while deleting leaves a ``.replaced-<token>`` without index, which
the next save of the series (knowing the token) deletes (data files only; anything else is kept
and reported). A ``<name>`` that is not a checkpoint (nor an empty directory), or is a symbolic
link, is never touched.

A checkpoint's *own files* (`own_files`) are ``index.json``, ``.metadata`` ([Note: the .metadata
marker] in ``checkpoint/_format/_index_model.py``) and the data files its index lists;
`delete_own_files` deletes those (index first) and the directory only if then empty.

[Note: commit by a pointer]
Where the storage cannot rename atomically (``atomic_rename`` False: an object store, fsspec's
``memory://``) nothing is renamed or copied. A save writes its files once, in place, into its
own folder ``<name>/.v-<token>`` (`temp_dir_for`) and commits by one PUT of ``<name>/index.json``,
a *pointer* (``{"format": ..., "version": 3, "at": ".v-<token>", "save_id": <token>}``,
``_format.pointer_bytes``). A reader sees the old pointer or the new one, follows it once and
reads only that folder, whose files no save changes. A version stops being current when a later
save commits (*superseded*) or ``keep_last`` rotates it away (its pointer deleted at once).
**The rule**: its folder is deleted no earlier than the start of the next save of the series
after that (listed in the record's ``deleting`` with ``"old"``, [Note: deleting through the
record] in ``_series.py``): a reader has at least one save interval to finish; a slower one finds
files gone and is told to retry, never a mix. A killed save leaves the last committed pointer;
its ``.v-<token>`` folder is deleted by the next save of the series. A checkpoint written before
pointers loads as ever and is superseded (`superseded`) the same way. POSIX keeps its rename.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .._base import CheckpointError, parse_json_strict
from .._format import (DCP_MARKER, FORMAT_NAME, INCOMPLETE_MARK, INDEX_FILE, MAX_INDEX_BYTES, PART_SUFFIX, VERSION_MARK,
                       own_names, pointer_at, pointer_bytes)
from .._storage import Storage

__all__ = ["temp_dir_for", "replaced_dir_for", "check_target", "commit", "own_files", "delete_own_files",
           "recover_replaced", "intact_replaced", "stand_in", "interrupted_save", "is_checkpoint", "index_of",
           "remove_temp", "superseded", "REPLACED_MARK"]

REPLACED_MARK = ".replaced-"


def temp_dir_for(storage: Storage, path: str, token: str) -> str:
    """Where the save ``token`` of ``path`` writes: a sibling ``.<name>.incomplete-<token>``
    renamed into place, or where rename is not atomic its own folder ``<name>/.v-<token>``
    ([Note: commit by a pointer])."""
    if not storage.atomic_rename:
        return storage.join(path, VERSION_MARK + token)
    return storage.join(storage.parent(path), f".{storage.name(path)}{INCOMPLETE_MARK}{token}")


def replaced_dir_for(storage: Storage, path: str, token: str) -> str:
    return storage.join(storage.parent(path), f".{storage.name(path)}{REPLACED_MARK}{token}")


def index_of(storage: Storage, path: str) -> dict | None:
    """The parsed index of the checkpoint directory ``path`` (a real directory, not a symlink,
    holding a regular ``index.json`` of this format), or None. Never opens a FIFO or a device."""
    file = storage.join(path, INDEX_FILE)
    if storage.atomic_rename and (storage.kind(path) != "dir" or storage.kind(file) != "file"):
        return None  # (elsewhere read_small itself refuses what is not a regular file)
    try:
        raw = parse_json_strict(storage.read_small(file, MAX_INDEX_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError, CheckpointError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT_NAME else None


def is_checkpoint(storage: Storage, path: str) -> bool:
    return index_of(storage, path) is not None


def superseded(raw: dict | None) -> list[str]:
    """What a pointer commit over the index ``raw`` leaves behind in the checkpoint's folder: the
    version folder a pointer names, or the own files of an index written in place (before
    pointers), the index itself excepted ([Note: commit by a pointer])."""
    if raw is None:
        return []
    at = pointer_at(raw)
    return [at] if at is not None else sorted(own_names(raw) - {INDEX_FILE})


def own_files(storage: Storage, path: str) -> set[str]:
    """The names inside checkpoint ``path`` that the format wrote (``_format.own_names``: the
    index and its temporary name, the ``.metadata`` marker, the data files and index parts it lists)."""
    return own_names(index_of(storage, path))


def check_target(storage: Storage, path: str, replaceable: Callable[[Storage, str], bool] | None = None) -> dict | None:
    """Raise if ``path`` exists and is neither a checkpoint (``replaceable``, default
    `is_checkpoint`) nor an empty directory; also when it cannot be a directory at all (it lies
    under a file). Returns the checkpoint's index (a pointer, or in place) when it is one."""
    if replaceable is None:
        raw = index_of(storage, path)  # one request on an object store: asked first
        if raw is not None:
            return raw
        replaceable = is_checkpoint
    where = storage.url(path)
    kind = storage.kind(path)
    if kind == "missing":
        parent = storage.parent(path)
        while parent and storage.kind(parent) == "missing" and storage.parent(parent) != parent:
            parent = storage.parent(parent)
        if storage.kind(parent) not in ("dir", "missing"):
            raise CheckpointError(f"{where} cannot be created: {storage.url(parent)} is a file, not a folder. Save to "
                                  "a path inside a folder")
        return None
    if kind == "link":
        raise CheckpointError(f"{where} is a symbolic link; refusing to replace it. Save to the directory it points to, "
                              "or to a new path")
    if kind == "dir" and (replaceable(storage, path) or not storage.list(path)):
        return None
    if kind == "dir" and interrupted_save(storage, path):
        return None  # a first save killed before its pointer: the series' cleanup deletes its folder
    raise CheckpointError(
        f"{where} exists and is not a shardwise checkpoint; refusing to replace it. Save to a new path or "
        "remove it first"
    )


def _move_user_files(storage: Storage, old: str, new: str, own: Callable[[Storage, str], set[str]]) -> list[str]:
    """Move what the format did not write from checkpoint ``old`` into ``new``; returns names
    that could not be moved (a name the new checkpoint uses itself)."""
    ours, left = own(storage, old), []
    for name in storage.list(old):
        if name in ours:
            continue
        if storage.kind(storage.join(new, name)) != "missing":
            left.append(name)
        else:
            storage.rename(storage.join(old, name), storage.join(new, name))
    return left


def delete_own_files(storage: Storage, path: str, own: Callable[[Storage, str], set[str]] | None = None,
                     names: set[str] | None = None) -> list[str]:
    """Delete checkpoint ``path``'s own files (``names``, else ``own``, default `own_files`; the
    index first) and the directory when nothing else is in it; returns the names of other
    entries left in place. Raises `OSError` when a file of ours cannot be deleted (permissions,
    a read-only mount): nothing is reported as removed that was not."""
    ours = names if names is not None else (own or own_files)(storage, path)
    for name in [n for n in ours if n == INDEX_FILE] + sorted(ours - {INDEX_FILE}):
        file = storage.join(path, name)
        if not storage.atomic_rename or storage.kind(file) in ("file", "link"):
            with contextlib.suppress(FileNotFoundError):
                storage.delete(file)
    left = storage.list(path)
    if not left:
        storage.rmdir(path)
    return left


def _finish_replace(storage: Storage, old: str, path: str,
                    own: Callable[[Storage, str], set[str]] | None = None) -> list[str]:
    """After the swap: move the user's files from ``old`` into ``path``, delete the rest of
    ``old`` (only if nothing but our files is left). Returns what stayed in ``old``."""
    own = own or own_files
    left = _move_user_files(storage, old, path, own)
    if left:
        return left
    return delete_own_files(storage, old, own)


def commit(storage: Storage, tmp: str, path: str, token: str,
           replaceable: Callable[[Storage, str], bool] | None = None,
           own: Callable[[Storage, str], set[str]] | None = None) -> list[str]:
    """Move the finished ``tmp`` directory to ``path`` (see [Note: atomic commit]). Returns
    entries of a replaced checkpoint that could not be moved over (left in its
    ``.replaced-`` directory). Where rename is not atomic, ``tmp`` is ``<path>/.v-<token>`` and
    the commit is one write of the pointer ([Note: commit by a pointer])."""
    if not storage.atomic_rename:
        storage.write_atomic(storage.join(path, INDEX_FILE), pointer_bytes(token))
        return []
    parent = storage.parent(path)
    storage.fsync_dir(tmp)
    check_target(storage, path, replaceable)
    old = None
    kind = storage.kind(path)
    if kind == "dir" and not storage.list(path):
        storage.rmdir(path)
    elif kind == "dir":
        old = replaced_dir_for(storage, path, token)
        storage.rename(path, old)
    storage.rename(tmp, path)
    storage.fsync_dir(parent)
    if old is None:
        return []
    left = _finish_replace(storage, old, path, own)
    storage.fsync_dir(parent)
    return [storage.url(storage.join(old, n)) for n in left]


def _replaced_copies(storage: Storage, path: str, token: str | None) -> list[str]:
    parent, name = storage.parent(path), storage.name(path)
    prefix = f".{name}{REPLACED_MARK}"
    try:
        names = storage.list(parent)
    except (OSError, FileNotFoundError):
        return []
    return [storage.join(parent, n) for n in names
            if n.startswith(prefix) and (token is None or n == prefix + token)]


def intact_replaced(storage: Storage, path: str) -> str | None:
    """The newest intact ``.<name>.replaced-<hex>`` checkpoint next to the missing ``path`` (a
    replace between its two renames, under way or interrupted), or None. Reads only."""
    found = [(int((index_of(storage, p) or {}).get("created_unix_ns") or 0), p)
             for p in _replaced_copies(storage, path, None) if is_checkpoint(storage, p)]
    return max(found)[1] if found else None


_LEFTOVER_SUFFIXES = (".safetensors", PART_SUFFIX, INDEX_FILE + ".tmp")


def stand_in(storage: Storage, path: str) -> str | None:
    """The intact ``.<name>.replaced-<token>`` copy that a reader of the missing ``path`` reads
    in its place (a replace between its two renames, under way or interrupted: the last
    committed version of ``path``), or None. Reads only."""
    return intact_replaced(storage, path) if storage.kind(path) == "missing" else None


def interrupted_save(storage: Storage, path: str) -> str | None:
    """Where rename is not atomic: the URL of a save's ``.v-<token>`` folder in ``path`` when
    ``path`` holds nothing but such folders (a first save writing, or killed before its
    pointer; or a checkpoint rotated away), else None. Reads only."""
    if storage.atomic_rename or storage.kind(path) != "dir":
        return None
    names = storage.list(path)
    ok = names and all(n.startswith(VERSION_MARK) for n in names)
    return storage.url(storage.join(path, names[0])) if ok else None


def recover_replaced(storage: Storage, path: str, token: str | None = None) -> str | None:
    """Repair a replace that stopped between its two renames, or while deleting the old copy.

    If ``<name>`` is missing and a ``.<name>.replaced-<token>`` checkpoint exists (the newest,
    when ``token`` is None), rename it back to ``<name>``. If ``<name>`` exists and ``token``
    is given, finish that replace: move user files over and delete the old copy; an old copy
    whose index is already gone (the kill came while deleting it) loses its remaining data
    files (``*.safetensors``, ``index.json.tmp``, ``.metadata``; anything else is kept and named). Returns a
    sentence saying what was done, or None when there was nothing to do.
    """
    if not storage.atomic_rename:
        return None  # nothing is renamed there ([Note: commit by a pointer])
    copies = _replaced_copies(storage, path, token)
    intact = [p for p in copies if is_checkpoint(storage, p)]
    if storage.kind(path) == "missing":
        newest = intact_replaced(storage, path) if token is None else (intact[0] if intact else None)
        if newest is None:
            return None
        storage.rename(newest, path)
        storage.fsync_dir(storage.parent(path))
        return f"restored {storage.url(path)} from {storage.url(newest)}, left there by a replace that did not finish"
    if token is None or not is_checkpoint(storage, path) or not copies:
        return None
    old = copies[0]
    if intact:
        left = _finish_replace(storage, old, path)
    else:  # the index is gone: everything of the format left is data files (user files were moved first)
        names = {n for n in storage.list(old) if (n.endswith(_LEFTOVER_SUFFIXES) or n == DCP_MARKER)
                 and storage.kind(storage.join(old, n)) == "file"}
        left = delete_own_files(storage, old, names=names)
    storage.fsync_dir(storage.parent(path))
    return (f"finished replacing {storage.url(path)}: removed the old copy {storage.url(old)}"
            + (f" (kept {left})" if left else ""))


def remove_temp(storage: Storage, tmp: str) -> bool:
    """Delete a save's temporary ``.incomplete-`` directory, or its ``.v-<token>`` folder unless
    a pointer names it (committed); True if it existed."""
    name = storage.name(tmp)
    if name.startswith(VERSION_MARK):
        if pointer_at(index_of(storage, storage.parent(tmp))) == name:
            return False
    elif INCOMPLETE_MARK not in name or storage.kind(tmp) != "dir":
        return False
    if storage.kind(tmp) != "dir":
        return False
    try:
        storage.rmtree(tmp)
    except OSError:
        return False
    return True
