"""Atomic commit of a checkpoint directory, replacing one safely, and deleting only our own files.

[Note: atomic commit]
A save writes everything into a sibling temporary directory ``.<name>.incomplete-<token>``:
first the data files (each fsynced by the rank that wrote it), then ``index.json`` (written to
``index.json.tmp``, fsynced, renamed), then the directory itself is fsynced and renamed to
``<name>``, and the parent directory is fsynced. ``rename`` is atomic, so ``<name>`` either
does not exist or is complete; a job killed at any point leaves earlier checkpoints untouched
and at worst a directory whose name says ``incomplete`` and which has no ``index.json``
(every reader refuses it with a message saying so). ``tests/test_checkpoint_commit_order.py``
checks this order of calls. Every call goes through a storage ([Note: storage semantics] in
``_storage/_protocol.py``); where rename is not atomic (an object store) the storage copies
with ``index.json`` last, which keeps the commit atomic for readers ([Note: commit on an object
store] in ``_storage/_fsspec.py``).

If ``<name>`` already is a checkpoint it is replaced: it is renamed away to
``.<name>.replaced-<token>`` first, the new one is renamed into place, then the files of the
old one that the checkpoint format did not write (a ``config.json``, a ``tokenizer/`` folder a
user put there) are moved into the new one, and only then the rest of the old one is deleted
(index first). A crash between the two renames leaves ``<name>`` missing and the intact old
checkpoint in ``.<name>.replaced-<token>``: readers read that copy in place
(`stand_in`; also `latest_checkpoint`, which names ``<name>``), and the next save of the series
renames it back (`recover_replaced`, through the series record). Where rename copies (an object
store) the same holds for a ``<name>`` left without ``index.json`` by a commit killed between
deleting the old index and copying in the new one. A crash while the old copy is deleted leaves a
``.replaced-<token>`` directory without an index: the next save of the series, which knows the
token from its record, deletes what is left of it (only data files; anything else is kept and
reported). A ``<name>`` that exists but is not a checkpoint (and not an empty directory), or is
a symbolic link, is never touched.

A checkpoint's *own files* (`own_files`) are ``index.json``, ``.metadata`` ([Note: the .metadata
marker] in ``checkpoint/_format/_index_model.py``) and the data files its index lists; `delete_own_files` deletes those (index first, so the directory stops being a
checkpoint at once) and the directory only if nothing else is left in it.
"""

from __future__ import annotations

from collections.abc import Callable

from .._base import CheckpointError, parse_json_strict
from .._format import (DCP_MARKER, FORMAT_NAME, INCOMPLETE_MARK, INDEX_FILE, MAX_INDEX_BYTES, PART_SUFFIX, own_names,
                       plain_file_name)
from .._storage import Storage

__all__ = ["temp_dir_for", "replaced_dir_for", "check_target", "commit", "own_files", "delete_own_files",
           "recover_replaced", "intact_replaced", "stand_in", "interrupted_save", "is_checkpoint", "index_of",
           "remove_temp", "REPLACED_MARK"]

REPLACED_MARK = ".replaced-"


def temp_dir_for(storage: Storage, path: str, token: str) -> str:
    return storage.join(storage.parent(path), f".{storage.name(path)}{INCOMPLETE_MARK}{token}")


def replaced_dir_for(storage: Storage, path: str, token: str) -> str:
    return storage.join(storage.parent(path), f".{storage.name(path)}{REPLACED_MARK}{token}")


def index_of(storage: Storage, path: str) -> dict | None:
    """The parsed index of the checkpoint directory ``path`` (a real directory, not a symlink,
    holding a regular ``index.json`` of this format), or None. Never opens a FIFO or a device."""
    file = storage.join(path, INDEX_FILE)
    if storage.kind(path) != "dir" or storage.kind(file) != "file":
        return None
    try:
        raw = parse_json_strict(storage.read_small(file, MAX_INDEX_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError, CheckpointError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT_NAME else None


def is_checkpoint(storage: Storage, path: str) -> bool:
    return index_of(storage, path) is not None


def own_files(storage: Storage, path: str) -> set[str]:
    """The names inside checkpoint ``path`` that the format wrote (``_format.own_names``: the
    index and its temporary name, the ``.metadata`` marker, the data files and index parts it lists)."""
    return own_names(index_of(storage, path))


def check_target(storage: Storage, path: str, replaceable: Callable[[Storage, str], bool] | None = None) -> None:
    """Raise if ``path`` exists and is neither a checkpoint (``replaceable``, default
    `is_checkpoint`) nor an empty directory; also when it cannot be a directory at all (it lies
    under a file)."""
    replaceable = replaceable or is_checkpoint
    where = storage.url(path)
    kind = storage.kind(path)
    if kind == "missing":
        parent = storage.parent(path)
        while parent and storage.kind(parent) == "missing" and storage.parent(parent) != parent:
            parent = storage.parent(parent)
        if storage.kind(parent) not in ("dir", "missing"):
            raise CheckpointError(f"{where} cannot be created: {storage.url(parent)} is a file, not a folder. Save to "
                                  "a path inside a folder")
        return
    if kind == "link":
        raise CheckpointError(f"{where} is a symbolic link; refusing to replace it. Save to the directory it points to, "
                              "or to a new path")
    if kind == "dir" and (replaceable(storage, path) or not storage.list(path)):
        return
    if kind == "dir" and not storage.atomic_rename and _leftover_next_to_copy(storage, path):
        return  # a copying rename killed half way: the save's cleanup (or `commit`) clears it
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
        if storage.kind(file) in ("file", "link"):
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
    ``.replaced-`` directory)."""
    parent = storage.parent(path)
    storage.fsync_dir(tmp)
    check_target(storage, path, replaceable)
    old = None
    kind = storage.kind(path)
    if kind == "dir" and not storage.atomic_rename and storage.kind(storage.join(path, INDEX_FILE)) != "file":
        for name in _leftover_next_to_copy(storage, path) or []:
            storage.delete(storage.join(path, name))
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
    """The intact ``.<name>.replaced-<token>`` copy that a reader of ``path`` reads in its place
    (the last committed version of ``path``), or None. Reads only. That is the case when
    ``path`` is missing (a replace between its two renames, under way or interrupted) and,
    where rename copies (an object store, [Note: commit on an object store] in
    ``_storage/_fsspec.py``), when ``path`` is a folder without ``index.json`` holding only what
    a copying rename leaves there (the format's data files and names of the old copy): a
    replace stopped after deleting the old ``index.json`` and before copying in the new one.
    The caller knows ``path`` is not a checkpoint (this does not read its index)."""
    kind = storage.kind(path)
    if kind == "missing":
        return intact_replaced(storage, path)
    if kind != "dir" or storage.atomic_rename or storage.kind(storage.join(path, INDEX_FILE)) != "missing":
        return None
    old = intact_replaced(storage, path)
    if old is None:
        return None
    theirs = set(storage.list(old))
    ok = all(n in theirs or n.endswith(_LEFTOVER_SUFFIXES) or n == DCP_MARKER for n in storage.list(path))
    return old if ok else None


def interrupted_save(storage: Storage, path: str) -> str | None:
    """Where rename copies: the URL of a save's ``.<name>.incomplete-`` or ``.replaced-`` folder
    next to ``path`` when ``path`` is a folder without ``index.json`` (a commit copying into it,
    under way or killed), else None. Reads only."""
    if storage.atomic_rename or storage.kind(path) != "dir" or storage.kind(storage.join(path, INDEX_FILE)) != "missing":
        return None
    parent, prefix = storage.parent(path), f".{storage.name(path)}"
    try:
        names = storage.list(parent)
    except OSError:
        return None
    found = [n for n in names if n.startswith(prefix + INCOMPLETE_MARK) or n.startswith(prefix + REPLACED_MARK)]
    return storage.url(storage.join(parent, sorted(found)[0])) if found else None


def recover_replaced(storage: Storage, path: str, token: str | None = None) -> str | None:
    """Repair a replace that stopped between its two renames, or while deleting the old copy.

    If ``<name>`` is missing and a ``.<name>.replaced-<token>`` checkpoint exists (the newest,
    when ``token`` is None), rename it back to ``<name>``. If ``<name>`` exists and ``token``
    is given, finish that replace: move user files over and delete the old copy; an old copy
    whose index is already gone (the kill came while deleting it) loses its remaining data
    files (``*.safetensors``, ``index.json.tmp``, ``.metadata``; anything else is kept and named). Returns a
    sentence saying what was done, or None when there was nothing to do.
    """
    if token is not None and not storage.atomic_rename:
        first = _replaced_copies(storage, path, token)
        _clear_copy_leftovers(storage, path, first[0] if first else None)
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


def _twin(storage: Storage, a: str, b: str) -> bool:
    """Whether files ``a`` and ``b`` hold the same bytes (one a copy of the other)."""
    try:
        if storage.kind(a) != "file" or storage.kind(b) != "file" or storage.size(a, False) != storage.size(b, False):
            return False
        n = storage.size(a, False)
        return storage.read_small(a, n) == storage.read_small(b, n)
    except (OSError, CheckpointError):
        return False


def _copy_leftover(storage: Storage, path: str, old: str | None) -> list[str] | None:
    """The names in the folder ``path`` (not a checkpoint) when each is a data file of the
    format or a copy of the same name in ``old`` (a ``.replaced-`` copy): what a copying rename
    killed half way leaves at ``path``; else None (``path`` holds something else: keep it)."""
    names = storage.list(path)
    ok = all(storage.kind(storage.join(path, n)) == "file" and (
        n.endswith(_LEFTOVER_SUFFIXES) or n == DCP_MARKER
        or (old is not None and _twin(storage, storage.join(path, n), storage.join(old, n)))) for n in names)
    return names if names and ok else None


def _leftover_next_to_copy(storage: Storage, path: str) -> list[str] | None:
    """`_copy_leftover` of ``path`` against the intact ``.replaced-`` copy next to it; None
    without one (a folder of safetensors files alone may be a user's: never touched)."""
    old = intact_replaced(storage, path)
    return None if old is None else _copy_leftover(storage, path, old)


def _clear_copy_leftovers(storage: Storage, path: str, old: str | None) -> None:
    """Undo what a copying rename (a storage without atomic rename: [Note: commit on an object
    store] in ``_storage/_fsspec.py``) left half done when its process was killed, so that the
    POSIX recovery of `recover_replaced` applies:

    * ``path`` a folder without index (killed while ``path`` was deleted after being copied to
      ``old``, or while the new checkpoint was copied into ``path``; ``path`` was missing, empty
      or a checkpoint when the save began, `check_target`): when each of its files is a data
      file of the format or a copy of ``old``'s, delete them, so ``path`` is missing and an
      intact ``old`` is renamed back;
    * ``path`` a checkpoint and ``old`` the same one (same ``save_id``: killed after copying
      ``path`` to ``old``, before deleting ``path``), or ``old`` a partial copy without index
      (killed while copying): delete the files of ``old`` that ``path`` holds too;
    * ``path`` the new checkpoint and ``old`` intact: a user file whose move was killed after
      the copy is in both; delete ``old``'s copy (the move then finishes as usual).

    Files found in only one place, other than the format's data files, are never deleted."""
    if storage.kind(path) == "dir" and not is_checkpoint(storage, path):
        for n in _copy_leftover(storage, path, old) or []:
            storage.delete(storage.join(path, n))
        return
    here = index_of(storage, path)
    if here is None or old is None:
        return
    there = index_of(storage, old)
    same = there is not None and there.get("save_id") == here.get("save_id")
    keep = set() if same or there is None else own_files(storage, old)
    for n in sorted(storage.list(old), key=lambda n: n != INDEX_FILE):  # the index first: old stops being one
        if n not in keep and _twin(storage, storage.join(old, n), storage.join(path, n)) and (n != INDEX_FILE or same):
            storage.delete(storage.join(old, n))


def remove_temp(storage: Storage, tmp: str) -> bool:
    """Delete a temporary ``.incomplete-`` directory this process created; True if it existed."""
    if INCOMPLETE_MARK not in storage.name(tmp) or storage.kind(tmp) != "dir":
        return False
    try:
        storage.rmtree(tmp)
    except OSError:
        return False
    return True
