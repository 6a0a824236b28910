"""The `Storage` protocol: every file-system call of ``shardwise.checkpoint`` goes through one.

A storage holds named files in folders, with paths in its own strings (`Storage.url` turns one
back into what a user would type). The code above this layer never calls ``os`` or ``open`` on
checkpoint files, so a new storage is one class implementing this protocol (docs/checkpoint.md,
"A new storage").

[Note: storage semantics]
What the commit protocol ([Note: atomic commit] in ``checkpoint/_series/_commit.py``) relies on, per method:

* ``kind(path)`` never follows a symbolic link and never opens anything: ``"missing"``,
  ``"file"`` (a regular file), ``"dir"``, ``"link"`` or ``"other"`` (FIFO, device, socket).
* ``open_read``/``read_small``/``size`` never open what is not a regular file (a FIFO would
  block forever): they check first and raise `CheckpointError` naming the file. With
  ``follow=False`` they refuse a symbolic link. ``read_small`` refuses a file larger than its
  ``limit`` before reading a byte.
* ``open_write(path)`` creates or truncates; ``WriteHandle.sync()`` returns once the bytes are
  durable (fsync on POSIX; a completed upload on an object store).
* ``write_atomic(path, data)``: readers see the old content or the new, whole; a failure leaves
  no temporary file behind.
* ``rename(src, dst)`` of a directory: ``dst`` must not exist; one atomic step. Called only
  where ``atomic_rename`` is True; elsewhere a save commits by a pointer ([Note: commit by a
  pointer] in ``checkpoint/_series/_commit.py``) and ``rename`` may refuse.
* ``fsync_dir(path)`` makes a folder's entries durable; a no-op where there is no such notion.
* ``list(path)`` the entry names of a folder (no ``.``/``..``); ``delete`` one file; ``rmdir``
  an empty folder; ``rmtree`` a folder and everything in it, never following links. Where
  folders are key prefixes ([Note: folders on an object store] in ``_fsspec.py``) an empty
  folder and a missing one are the same.
* ``lock(folder)`` excludes every other holder of the folder's lock, in this and other processes
  on the same host (``flock`` on POSIX); object stores have none: one job saves a series at a
  time there (docs/checkpoint.md).
* ``holder()`` describes the running process for the series record; ``holder_alive(h)`` says
  whether it may still run (its save must then not be cleaned up); another host's is finished.
* ``open_dir(path)`` pins a checkpoint directory for a reader: reads through the returned
  `DirView` see that one version even if a writer renames a new one into place (POSIX: a
  directory file descriptor), and ``DirView.is_current()`` says whether ``path`` still names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol

__all__ = ["DirView", "Kind", "ReadHandle", "Storage", "WriteHandle"]

Kind = Literal["missing", "file", "dir", "link", "other"]


class ReadHandle(Protocol):
    """An open regular file, read by byte ranges."""

    name: str  # for messages: the file as the user would name it
    size: int

    def readinto(self, views: Sequence[memoryview], offset: int) -> int:
        """Fill ``views`` in order from the bytes at ``offset``; returns the bytes read (fewer
        than asked only at the end of the file; 0 there). One request where the storage can
        (``preadv`` on POSIX)."""
        ...

    def read(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file, or on a short read)."""
        ...

    def close(self) -> None: ...


class WriteHandle(Protocol):
    def write(self, data: memoryview | bytes) -> None: ...

    def flush(self) -> None:
        """Hand buffered bytes to the storage (not yet durable: that is `sync`)."""
        ...

    def sync(self) -> None:
        """Flush and make durable everything written so far (see [Note: storage semantics])."""
        ...

    def close(self) -> None: ...


class DirView(Protocol):
    """One version of a directory, pinned for reading (see ``Storage.open_dir``)."""

    path: str
    pinned: bool  # True: reads see the pinned version whatever happens to the path (POSIX)

    def kind(self, name: str) -> Kind: ...

    def size(self, name: str, follow: bool = False) -> int: ...

    def open_read(self, name: str, follow: bool = False) -> ReadHandle: ...

    def read_small(self, name: str, limit: int, follow: bool = False) -> bytes: ...

    def list(self) -> list[str]: ...

    def is_current(self) -> bool:
        """Whether the directory's path still names the version this view pinned."""
        ...

    def close(self) -> None: ...


class Storage(Protocol):
    atomic_rename: bool
    read_concurrency: int  # the most reads a load runs at once (threads); 1 where one at a time is best

    def url(self, path: str) -> str: ...

    def norm(self, path: str) -> str:
        """The canonical form of ``path`` (absolute for POSIX)."""
        ...

    def join(self, *parts: str) -> str: ...

    def parent(self, path: str) -> str: ...

    def name(self, path: str) -> str: ...

    def kind(self, path: str) -> Kind: ...

    def size(self, path: str, follow: bool = True) -> int: ...

    def open_read(self, path: str, follow: bool = True) -> ReadHandle: ...

    def read_small(self, path: str, limit: int, follow: bool = False) -> bytes: ...

    def open_write(self, path: str) -> WriteHandle: ...

    def write_atomic(self, path: str, data: bytes) -> None: ...

    def mkdir(self, path: str, parents: bool = False) -> None: ...

    def rename(self, src: str, dst: str) -> None: ...

    def fsync_dir(self, path: str) -> None: ...

    def list(self, path: str) -> list[str]: ...

    def delete(self, path: str) -> None: ...

    def rmdir(self, path: str) -> None: ...

    def rmtree(self, path: str) -> None: ...

    def lock(self, folder: str) -> AbstractContextManager[None]: ...

    def holder(self) -> dict: ...

    def holder_alive(self, holder: dict) -> bool: ...

    def open_dir(self, path: str) -> DirView: ...
