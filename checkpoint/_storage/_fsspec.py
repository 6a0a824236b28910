"""`FsspecStorage`: any fsspec file system (``memory://``, ``file://``, ``s3://``, ``gs://``, ...).

Implements [Note: storage semantics] in ``_protocol.py`` on an ``fsspec.AbstractFileSystem``.
On ``file://`` rename is ``os.rename`` (atomic) and the lock an ``flock``, as `PosixStorage`.
Elsewhere (object stores, ``memory://``):

[Note: commit on an object store]
There is no rename (``atomic_rename`` False; ``rename`` refused): a save writes its files once
into its own folder and commits by one PUT of a pointer ([Note: commit by a pointer] in
``checkpoint/_series/_commit.py``); ``write_atomic`` is one ``pipe_file``. The lock only orders
this process's threads: one job saves a series at a time. docs/checkpoint.md, "On an object
store", lists a save's requests.

[Note: folders on an object store]
On an object store (``virtual_dirs``: every fsspec file system but local and ``memory://``) a
folder is a key prefix, existing while an object lies under it: ``mkdir`` creates nothing, an
emptied folder is gone (``list`` gives ``[]``, ``rmdir`` does nothing, ``kind`` says
``"missing"``). s3fs caches listings forever while other processes change the store, so every
``kind``/``list`` first drops the cache for the path. Every object is a regular file, so
``read_small`` is one ranged GET (an oversized file is refused from the one byte past its limit).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec  # untyped: pyproject.toml [tool.mypy] ignores its missing stubs

from .._base import CheckpointError
from ._posix import PosixStorage, holder_alive, process_holder
from ._protocol import Kind

__all__ = ["FsspecStorage"]

_locks: dict[tuple[int, str], threading.Lock] = {}
_locks_guard = threading.Lock()


class _Reader:
    """An open file (``f``), or on an object store (``f`` None) an object read by one ranged GET
    per call, never more bytes than asked for."""

    def __init__(self, f: Any, name: str, size: int, fs: Any = None, path: str = "") -> None:
        self._f, self.name, self.size, self._fs, self._path = f, name, size, fs, path

    def readinto(self, views: Sequence[memoryview], offset: int) -> int:
        if self._f is None:
            end = min(self.size, offset + sum(len(v) for v in views))
            data = memoryview(self._fs.cat_file(self._path, start=offset, end=end)) if end > offset else memoryview(b"")
            done = 0
            for v in views:
                n = min(len(v), len(data) - done)
                v[:n] = data[done:done + n]
                done += n
                if n < len(v):
                    break
            return done
        self._f.seek(offset)
        done = 0
        for v in views:
            n = self._f.readinto(v)
            done += n or 0
            if not n or n < len(v):
                break
        return done

    def read(self, n: int, offset: int) -> bytes:
        if self._f is None:
            end = min(self.size, offset + n)
            return bytes(self._fs.cat_file(self._path, start=offset, end=end)) if end > offset else b""
        self._f.seek(offset)
        return bytes(self._f.read(n))

    def close(self) -> None:
        if self._f is not None:
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
    """A directory read by path, not pinned: the view remembers what it saw (the kind of each name
    it asked about, the bytes of each small file it read) and `is_current` compares that with
    what is there now. (A pointer's version folder needs none of it: [Note: commit on an object
    store].)"""

    pinned = False

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.path, self._s = path, storage
        self._seen: dict[str, tuple[int, str | None]] = {}
        self._kinds: dict[str, Kind] = {}
        if storage.virtual_dirs:
            return  # a prefix: whether it holds an index is the one question, asked by reading it
        kind = self._kinds[""] = storage.kind(path)
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

    def is_current(self) -> bool:
        return (all(self._s.kind(self._s.join(self.path, n) if n else self.path) == k for n, k in self._kinds.items())
                and all(self._digest(n, limit) == d for n, (limit, d) in self._seen.items()))

    def close(self) -> None:
        pass


class FsspecStorage:
    """Any fsspec file system (see the module docstring). ``FsspecStorage.from_url(url)`` gives
    the storage and the path inside it. ``read_concurrency``: the most reads a load keeps in
    flight at once (default 16 on an object store, 1 elsewhere)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, read_concurrency: int | None = None) -> None:
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        self.atomic_rename = self.local
        # an object store's folders are key prefixes: one exists while an object lies under it
        # (see [Note: folders on an object store]); fsspec's memory:// and the local disk keep real ones
        self.virtual_dirs = not self.local and "memory" not in protocols
        # ranged GETs a load keeps in flight at once (each read is one request there; 1 elsewhere)
        self.read_concurrency = read_concurrency or (16 if self.virtual_dirs else 1)
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
        if self.virtual_dirs:
            return _Reader(None, self.url(path), size, self.fs, path)
        try:
            return _Reader(self.fs.open(path, "rb"), self.url(path), size)
        except FileNotFoundError:
            raise CheckpointError(f"{self.url(path)} is missing") from None

    def read_small(self, path: str, limit: int, follow: bool = False) -> bytes:
        if self.virtual_dirs:  # one ranged GET: see [Note: folders on an object store]
            try:
                data = bytes(self.fs.cat_file(path, start=0, end=limit + 1))
            except FileNotFoundError:
                raise CheckpointError(f"{self.url(path)} is missing") from None
            if len(data) > limit:
                raise CheckpointError(f"{self.url(path)} has more than {limit} bytes, more than such a file can have; "
                                      "refusing to read it")
            return data
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
        if self.virtual_dirs:
            return  # a prefix needs no creating: it exists once an object is written under it
        if not parents and self.kind(path) != "missing":
            raise FileExistsError(path)
        if not parents and self.kind(self.parent(path)) == "missing":
            raise FileNotFoundError(self.parent(path))
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        if not self.local:
            raise OSError(f"{self.url(src)}: this storage cannot rename atomically (see [Note: commit on an object "
                          "store])")
        if self.kind(dst) != "missing":
            raise FileExistsError(f"{self.url(dst)} exists")
        os.rename(src, dst)

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
        if self.virtual_dirs:
            self.fs.rm_file(path)  # (deleting a missing object is no error there)
            return
        if self.kind(path) == "missing":
            raise FileNotFoundError(path)
        self.fs.rm_file(path)

    def rmdir(self, path: str) -> None:
        if self.virtual_dirs:
            return  # the prefix goes with its last object
        if self.list(path):
            raise OSError(f"{self.url(path)} is not empty")
        self.fs.rmdir(path)

    def rmtree(self, path: str) -> None:
        self._fresh(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            return
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
