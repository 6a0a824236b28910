"""`FsspecStorage`: any fsspec file system (``memory://``, ``file://``, ``s3://``, ``gs://``, ...).

Implements [Note: storage semantics] in ``_protocol.py`` on an ``fsspec.AbstractFileSystem``.
On the local file system (``file://``) rename is ``os.rename`` (atomic) and the lock an
``flock``, as `PosixStorage`. Elsewhere (object stores, ``memory://``):

[Note: commit on an object store]
An object store has no atomic rename of a prefix: ``mv`` copies objects one by one. The commit
stays atomic because a directory is a checkpoint exactly when its ``index.json`` exists and
every reader reads the index first: `FsspecStorage.rename` copies every other object first and
``index.json`` last (``dst`` becomes a checkpoint only when complete), then deletes ``src``'s
``index.json`` first (``src`` stops being one at once) and the rest after (one batch delete).
A single object PUT is atomic on the stores fsspec serves, so ``write_atomic`` is one
``pipe_file``. A kill at any point leaves at least one complete copy (the old one until the new
one is complete); the half-done copies a kill can leave (a folder without index at ``<name>``,
a partial ``.replaced-`` copy, a user file in two places) are undone by the next save of the
series (``_clear_copy_leftovers`` in ``checkpoint/_series/_commit.py``). There is no
cross-process lock: one job saves a series at a time (the lock here only orders the threads of
this process). docs/checkpoint.md, "On an object store", lists the requests of a save.

[Note: folders on an object store]
On an object store (``virtual_dirs``: every fsspec file system but the local one and
``memory://``) a folder is a key prefix: it exists while an object lies under it. ``mkdir``
creates nothing, a folder whose last object is deleted is gone (``list`` answers ``[]`` and
``rmdir`` does nothing, as for an emptied folder), and ``kind`` says ``"missing"`` for an empty
one. s3fs caches listings and answers ``info`` from them forever; another process changes the
store behind that cache, so every ``kind``/``list`` first drops what is cached for the path.

[Note: readers on an object store]
A reader cannot pin a version (no directory descriptors). The `_View` remembers what it saw:
the kind of each name it asked about (the folder's own included) and the bytes of each small
file it read (``index.json``); `_View.is_current` compares them with what is there now, which
is how a load detects a replace that happened while it read and says "being replaced, retry"
(docs/checkpoint.md, "Readers and a writer"). A rename passes ``<name>`` through two states a
POSIX rename never shows: a folder without ``index.json`` (being copied in, or the rest being
deleted after the index) and, on an object store, no folder at all between the two renames of
a replace. A view that saw either is current only if nothing comes into or leaves the folder
for ``settle_s`` (1 s, or 20 times as long as one listing took when the store or the host is
slow; only on this error path): otherwise a rename is under way and the load says "retry",
not "not a checkpoint". This is a bound on time, not a proof: a writer stalled longer than
that between the two renames of a replace makes the load say "does not exist" once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec  # untyped: pyproject.toml [tool.mypy] ignores its missing stubs

from .._base import CheckpointError
from ._posix import PosixStorage, holder_alive, process_holder
from ._protocol import Kind

__all__ = ["FsspecStorage"]

_INDEX = "index.json"
_locks: dict[tuple[int, str], threading.Lock] = {}
_locks_guard = threading.Lock()


class _Reader:
    def __init__(self, f: Any, name: str, size: int) -> None:
        self._f, self.name, self.size = f, name, size

    def readinto(self, views: Sequence[memoryview], offset: int) -> int:
        self._f.seek(offset)
        done = 0
        for v in views:
            n = self._f.readinto(v)
            done += n or 0
            if not n or n < len(v):
                break
        return done

    def read(self, n: int, offset: int) -> bytes:
        self._f.seek(offset)
        return bytes(self._f.read(n))

    def close(self) -> None:
        self._f.close()


class _Writer:
    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: memoryview | bytes) -> None:
        self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def sync(self) -> None:
        self._f.flush()
        with contextlib.suppress(AttributeError, OSError, ValueError, NotImplementedError):
            os.fsync(self._f.fileno())  # the local file system; an object is durable once closed

    def close(self) -> None:
        self._f.close()


class _View:
    """A directory read by path: nothing is pinned, so the view remembers what it saw (the kind of
    each name it asked about, the bytes of each small file it read) and `is_current` compares
    that with what is there now (see [Note: readers on an object store])."""

    pinned = False
    settle_s = 1.0  # how long a folder without index.json must stay unchanged to be taken as such

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.path, self._s = path, storage
        self._seen: dict[str, tuple[int, str | None]] = {}
        self._kinds: dict[str, Kind] = {}
        kind = self._kinds[""] = storage.kind(path)
        if kind == "missing" and storage.virtual_dirs:
            return  # perhaps between the two renames of a replace: the index check says which
        if kind != "dir":
            raise CheckpointError(f"{storage.url(path)} does not exist" if kind == "missing" else
                                  f"{storage.url(path)} is a file, not a checkpoint directory")

    def kind(self, name: str) -> Kind:
        kind = self._kinds[name] = self._s.kind(self._s.join(self.path, name))
        return kind

    def size(self, name: str, follow: bool = False) -> int:
        return self._s.size(self._s.join(self.path, name), follow)

    def open_read(self, name: str, follow: bool = False) -> _Reader:
        return self._s.open_read(self._s.join(self.path, name), follow)

    def read_small(self, name: str, limit: int, follow: bool = False) -> bytes:
        try:
            data = self._s.read_small(self._s.join(self.path, name), limit, follow)
        except CheckpointError:
            self._seen[name] = (limit, None)
            raise
        self._seen[name] = (limit, hashlib.sha256(data).hexdigest())
        return data

    def list(self) -> list[str]:
        return self._s.list(self.path)

    def _digest(self, name: str, limit: int) -> str | None:
        try:
            return hashlib.sha256(self._s.read_small(self._s.join(self.path, name), limit)).hexdigest()
        except (CheckpointError, OSError):
            return None

    def _moving(self) -> bool:
        """Whether objects come into or leave this folder, which has no ``index.json``, within
        `settle_s`: a rename under way (copying in, or deleting the rest after the index)."""
        start = time.monotonic()
        listing = self._s.list(self.path)
        took = time.monotonic() - start  # a slow store (or a busy host) has longer gaps between a rename's steps
        deadline = time.monotonic() + max(self.settle_s, 20 * took)
        while time.monotonic() < deadline:
            time.sleep(max(0.05, took))
            if self._s.list(self.path) != listing:
                return True
        return False

    def is_current(self) -> bool:
        for name, kind in self._kinds.items():
            if self._s.kind(self._s.join(self.path, name) if name else self.path) != kind:
                return False
        for name, (limit, digest) in self._seen.items():
            if self._digest(name, limit) != digest:
                return False
        if self._s.virtual_dirs and (self._kinds.get(_INDEX) == "missing" or self._kinds[""] == "missing"):
            return not self._moving()
        return True

    def close(self) -> None:
        pass


class FsspecStorage:
    """Any fsspec file system (see the module docstring). ``FsspecStorage.from_url(url)`` gives
    the storage and the path inside it."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        self.atomic_rename = self.local
        # an object store's folders are key prefixes: one exists while an object lies under it
        # (see [Note: folders on an object store]); fsspec's memory:// and the local disk keep real ones
        self.virtual_dirs = not self.local and "memory" not in protocols
        self._posix = PosixStorage() if self.local else None

    @classmethod
    def from_url(cls, url: str) -> tuple[FsspecStorage, str]:
        fs, path = fsspec.core.url_to_fs(url)
        storage = cls(fs)
        return storage, storage.norm(path)

    def url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def norm(self, path: str) -> str:
        path = self.fs._strip_protocol(path)
        return os.path.abspath(path) if self.local else path.rstrip("/") or "/"

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def parent(self, path: str) -> str:
        return posixpath.dirname(path.rstrip("/")) or "/"

    def name(self, path: str) -> str:
        return posixpath.basename(path.rstrip("/"))

    def _fresh(self, path: str) -> None:
        """Forget what the file system cached about ``path`` (s3fs keeps listings, and answers
        ``info`` from them, forever): another process may have changed it since."""
        if not self.local:
            self.fs.invalidate_cache(path)

    def _kind_info(self, path: str) -> tuple[Kind, dict]:
        self._fresh(path)
        try:
            info = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return "missing", {}
        if info.get("islink"):
            return "link", info
        return {"file": "file", "directory": "dir"}.get(info.get("type"), "other"), info  # type: ignore[return-value]

    def kind(self, path: str) -> Kind:
        return self._kind_info(path)[0]

    def _regular(self, path: str, follow: bool) -> int:
        kind, info = self._kind_info(path)  # one request for a file (a HEAD on S3), not two
        if kind == "link" and follow:
            info = self.fs.info(path)
            kind = {"file": "file", "directory": "dir"}.get(info.get("type"), "other")  # type: ignore[assignment]
        if kind == "missing":
            raise CheckpointError(f"{self.url(path)} is missing")
        if kind == "link":
            raise CheckpointError(f"{self.url(path)} is a symbolic link; refusing to follow it (it must be a regular "
                                  "file inside the checkpoint directory)")
        if kind != "file":
            raise CheckpointError(f"{self.url(path)} is not a regular file")
        return int(info["size"])

    def size(self, path: str, follow: bool = True) -> int:
        return self._regular(path, follow)

    def open_read(self, path: str, follow: bool = True) -> _Reader:
        size = self._regular(path, follow)
        try:
            return _Reader(self.fs.open(path, "rb"), self.url(path), size)
        except FileNotFoundError:
            raise CheckpointError(f"{self.url(path)} is missing") from None

    def read_small(self, path: str, limit: int, follow: bool = False) -> bytes:
        size = self._regular(path, follow)
        if size > limit:
            raise CheckpointError(f"{self.url(path)} has {size} bytes, more than such a file can have ({limit}); "
                                  "refusing to read it")
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            raise CheckpointError(f"{self.url(path)} is missing") from None

    def open_write(self, path: str) -> _Writer:
        return _Writer(self.fs.open(path, "wb"))

    def write_atomic(self, path: str, data: bytes) -> None:
        if not self.atomic_rename:
            self.fs.pipe_file(path, data)  # one PUT: atomic on an object store
            return
        tmp = path + ".tmp"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm_file(tmp)
            raise

    def mkdir(self, path: str, parents: bool = False) -> None:
        if self.kind(path) != "missing" and not parents:
            raise FileExistsError(path)
        if self.virtual_dirs:
            return  # a prefix needs no creating: it exists once an object is written under it
        if not parents and self.kind(self.parent(path)) == "missing":
            raise FileNotFoundError(self.parent(path))
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        if self.kind(dst) != "missing":
            raise FileExistsError(f"{self.url(dst)} exists")
        if self.local:
            os.rename(src, dst)
            return
        if self.kind(src) != "dir":
            self.fs.mv(src, dst)
            return
        self._fresh(src)
        found = self.fs.find(src, detail=True)
        files = sorted(p for p, info in found.items() if info.get("type") == "file")
        rel = [posixpath.relpath(p, src) for p in files]
        if not self.virtual_dirs:
            self.fs.makedirs(dst, exist_ok=True)
        for p, r in sorted(zip(files, rel), key=lambda pr: pr[1] == _INDEX):  # the index last: see the note
            if not self.virtual_dirs:
                self.fs.makedirs(posixpath.dirname(posixpath.join(dst, r)), exist_ok=True)
            self.fs.cp_file(p, posixpath.join(dst, r))
        if _INDEX in rel:
            self.fs.rm_file(posixpath.join(src, _INDEX))  # src stops being a checkpoint first
        self.fs.rm(src, recursive=True)

    def fsync_dir(self, path: str) -> None:
        if self._posix is not None:
            self._posix.fsync_dir(path)

    def list(self, path: str) -> list[str]:
        self._fresh(path)
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            if self.virtual_dirs:
                return []  # an emptied prefix is gone: the same as an empty folder
            raise
        return sorted(n for n in (self.name(p) for p in names) if n not in ("", ".", ".."))

    def delete(self, path: str) -> None:
        if self.kind(path) == "missing":
            raise FileNotFoundError(path)
        self.fs.rm_file(path)

    def rmdir(self, path: str) -> None:
        if self.list(path):
            raise OSError(f"{self.url(path)} is not empty")
        if self.virtual_dirs:
            return  # the prefix went with its last object
        self.fs.rmdir(path)

    def rmtree(self, path: str) -> None:
        self._fresh(path)
        self.fs.rm(path, recursive=True)
        if not self.virtual_dirs and self.kind(path) == "dir":
            with contextlib.suppress(OSError, FileNotFoundError):
                self.fs.rmdir(path)

    @contextlib.contextmanager
    def lock(self, folder: str) -> Iterator[None]:
        with _locks_guard:
            lock = _locks.setdefault((id(self.fs), folder), threading.Lock())
        with lock:
            if self._posix is not None:
                with self._posix.lock(folder):
                    yield
            else:
                yield

    def holder(self) -> dict:
        return process_holder()

    def holder_alive(self, holder: dict) -> bool:
        return holder_alive(holder)

    def open_dir(self, path: str) -> _View:
        return _View(self, path)
