"""One checkpoint directory as one reader sees it, and the one checker of its data files.

`open_checkpoint` pins the directory (``Storage.open_dir``) and reads its index, following a
pointer once ([Note: commit by a pointer] in ``checkpoint/_series/_commit.py``). `CheckpointFiles`
opens each data file once and keeps it open until `close`, so a load reads the very bytes it
checked. `CheckpointFiles.header` is the file check ``load``, ``verify`` and ``inspect`` share: a
regular file (never a symlink for a shardwise checkpoint; a Hugging Face folder's may link into a
download cache) of the recorded size with a valid safetensors header; `CheckpointFiles.box_problem`
checks a box's key, dtype and shape. `CheckpointFiles.replaced` says whether the path no longer
names the version being read, so a problem is reported as "being replaced, retry" ([Note: readers
and a writer] in ``checkpoint/_load/_reader.py``).
"""

from __future__ import annotations

import os
import posixpath

from .._base import CheckpointError
from .._storage import DirView, ReadHandle, Storage, storage_for
from ._index import INDEX_FILE, Index, Pointer, SavedBox, read_index
from ._safetensors_io import DTYPE_CODES, Header, read_header

__all__ = ["CheckpointFiles", "open_checkpoint", "open_folder"]


class CheckpointFiles:
    """The data files of one checkpoint (or Hugging Face folder) ``path`` of ``storage``."""

    def __init__(self, storage: Storage, path: str, view: DirView, index: Index, follow_links: bool,
                 pointer: bytes | None = None) -> None:
        self.storage, self.path, self.view, self.index, self.follow_links = storage, path, view, index, follow_links
        self.pointer = pointer  # the bytes of the pointer followed to ``view`` (a version folder), if any
        self.pinned = view.pinned or pointer is not None
        self._handles: dict[str, ReadHandle] = {}
        self._headers: dict[str, Header] = {}

    @property
    def where(self) -> str:
        """The directory as the user names it (a path, or a URL)."""
        return self.storage.url(self.path)

    def url(self, name: str) -> str:
        return posixpath.join(self.where, name) if "://" in self.where else os.path.join(self.where, name)

    def handle(self, name: str) -> ReadHandle:
        """The open data file ``name`` (opened on first use, kept open until `close`)."""
        h = self._handles.get(name)
        if h is None:
            try:
                h = self.view.open_read(name, follow=self.follow_links)
            except CheckpointError as e:
                raise CheckpointError(f"data file {e}") from None
            self._handles[name] = h
        return h

    def header(self, name: str) -> Header:
        """The checked header of data file ``name``: a regular file of the size the index records
        (a `CheckpointError` says "missing", "truncated or replaced", ...), with a valid header."""
        if name in self._headers:
            return self._headers[name]
        h = self.handle(name)
        expected = self.index.files.get(name)
        if expected is not None and h.size != expected:
            raise CheckpointError(f"data file {self.url(name)} has {h.size} bytes but the index records {expected} "
                                  "(truncated or replaced)")
        self._headers[name] = read_header(h)
        return self._headers[name]

    def box_problem(self, key: str, saved: SavedBox) -> str | None:
        """None when data file ``saved.file`` (its header already read) holds ``saved.key`` with
        tensor ``key``'s dtype and the box's shape; else the sentence saying what it holds."""
        want = DTYPE_CODES[self.index.tensors[key].dtype]
        e = self.header(saved.file).entries.get(saved.key)
        if e is None:
            return (f"data file {self.url(saved.file)} does not hold key '{saved.key}' (tensor '{key}'); the file does "
                    "not belong to this index")
        if e.dtype != want or e.shape != saved.box.sizes:
            return (f"data file {self.url(saved.file)} holds key '{saved.key}' as {e.dtype} {list(e.shape)}, the "
                    f"index says {want} {list(saved.box.sizes)} (tensor '{key}'); the file does not belong to this "
                    "index")
        return None

    def replaced(self) -> bool:
        """Whether the path no longer names the version this reader pinned (a writer replaced it)."""
        return not self.view.is_current() if self.pointer is None else _repointed(self.storage, self.path, self.pointer)

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self.view.close()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _repointed(storage: Storage, path: str, pointer: bytes) -> bool:
    """Whether ``path``'s ``index.json`` is no longer the pointer ``pointer`` (a save committed since)."""
    try:
        return storage.read_small(storage.join(path, INDEX_FILE), 1 << 16) != pointer
    except (OSError, CheckpointError):
        return True


def open_checkpoint(path: str | os.PathLike, storage: Storage | None = None) -> CheckpointFiles:
    """Pin the checkpoint directory ``path`` (a path or URL; ``storage`` to choose one) and read
    its index (``_format.read_index``: a `CheckpointError` says what the directory is otherwise),
    following a pointer to the version folder it names."""
    storage, norm = storage_for(path, storage)
    view, pointer = storage.open_dir(norm), None
    try:
        try:
            return CheckpointFiles(storage, norm, view, read_index(view, storage), follow_links=False)
        except Pointer as p:
            view.close()
            pointer = p.raw
            view = storage.open_dir(storage.join(norm, p.at))
            return CheckpointFiles(storage, norm, view, read_index(view, storage), follow_links=False, pointer=pointer)
    except Pointer:
        view.close()
        raise CheckpointError(f"{storage.url(norm)}: the folder its index.json points to holds a pointer again; the "
                              "checkpoint is damaged") from None
    except CheckpointError as e:
        # the version read lost its index or files because a save replaced it and deleted the
        # old one: the path names another version now, nothing is damaged
        moved = not view.is_current() if pointer is None else _repointed(storage, norm, pointer)
        view.close()
        if moved:
            raise CheckpointError(f"checkpoint {norm} is being replaced by a save (its path now names another "
                                  "version than the one this load opened); nothing is damaged: retry the load") from e
        raise
    except BaseException:
        view.close()
        raise


def open_folder(storage: Storage, path: str, index: Index) -> CheckpointFiles:
    """The files of a folder described by an index built elsewhere (a Hugging Face folder, whose
    files may be symbolic links into a download cache)."""
    return CheckpointFiles(storage, path, storage.open_dir(path), index, follow_links=True)
