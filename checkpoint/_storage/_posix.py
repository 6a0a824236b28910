"""`PosixStorage`: the local file system through ``os``.

Implements [Note: storage semantics] in ``_protocol.py`` with POSIX calls: atomic ``rename``,
``fsync``/``fsync_dir``, ``lock`` an exclusive ``flock`` of the folder itself (no lock file), a
holder is host name and process id. Files are opened only after ``lstat``/``stat`` says regular,
with ``O_NONBLOCK`` (and ``O_NOFOLLOW`` unless following), and checked again with ``fstat``, so a
planted FIFO or device cannot block or feed a reader.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import stat
from collections.abc import Iterator, Sequence

from .._base import CheckpointError
from ._protocol import Kind

__all__ = ["PosixStorage", "process_holder", "holder_alive"]

_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _kind_of(st: os.stat_result) -> Kind:
    if stat.S_ISLNK(st.st_mode):
        return "link"
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return "other"


def _describe(e: OSError) -> str:
    return e.strerror or type(e).__name__


def process_holder() -> dict:
    """This process, as a pending save's ``holder`` (host name and process id)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def holder_alive(holder: dict) -> bool:
    """Whether the process ``holder`` may still run: alive on this host. Other hosts' are taken as finished."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Reader:
    """A regular file open for ``preadv`` (kernel read-ahead off: it would pull in neighbouring boxes)."""

    def __init__(self, fd: int, name: str, size: int) -> None:
        self.fd, self.name, self.size = fd, name, size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def readinto(self, views: Sequence[memoryview], offset: int) -> int:
        return os.preadv(self.fd, list(views[:_IOV_MAX]), offset)

    def read(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Writer:
    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")

    def write(self, data: memoryview | bytes) -> None:
        self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _open_regular(path: str, name: str, follow: bool, dir_fd: int | None = None) -> _Reader:
    """Open the regular file ``path`` (relative to ``dir_fd`` when given) without ever opening
    anything else: stat first, then open non-blocking and check the open file again."""
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow)
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except PermissionError:
        raise CheckpointError(f"{name}: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"{name}: {_describe(e)}") from None
    kind = _kind_of(st)
    if kind == "link":
        raise CheckpointError(f"{name} is a symbolic link; refusing to follow it (it must be a regular file inside "
                              "the checkpoint directory)")
    if kind != "file":
        raise CheckpointError(f"{name} is not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | os.O_CLOEXEC | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except PermissionError:
        raise CheckpointError(f"{name}: permission denied") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{name} is a symbolic link; refusing to follow it") from None
        raise CheckpointError(f"{name}: {_describe(e)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
        os.close(fd)
        raise CheckpointError(f"{name} is not a regular file")
    return _Reader(fd, name, st.st_size)


def _read_all(r: _Reader, limit: int) -> bytes:
    try:
        if r.size > limit:
            raise CheckpointError(f"{r.name} has {r.size} bytes, more than such a file can have ({limit}); refusing "
                                  "to read it")
        parts, pos = [], 0
        while pos < r.size:
            data = r.read(r.size - pos, pos)
            if not data:
                break
            parts.append(data)
            pos += len(data)
        return b"".join(parts)
    finally:
        r.close()


class _PinnedDir:
    """A directory pinned by a file descriptor: renames of its path do not change what it reads."""

    pinned = True

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist") from None
        except NotADirectoryError:
            raise CheckpointError(f"{path} is a file, not a checkpoint directory") from None
        except PermissionError:
            raise CheckpointError(f"{path}: permission denied (it may exist; this user cannot read it)") from None
        st = os.fstat(self._fd)
        self._id = (st.st_dev, st.st_ino)

    def kind(self, name: str) -> Kind:
        try:
            return _kind_of(os.stat(name, dir_fd=self._fd, follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return "missing"

    def size(self, name: str, follow: bool = False) -> int:
        r = _open_regular(name, os.path.join(self.path, name), follow, self._fd)
        r.close()
        return r.size

    def open_read(self, name: str, follow: bool = False) -> _Reader:
        return _open_regular(name, os.path.join(self.path, name), follow, self._fd)

    def read_small(self, name: str, limit: int, follow: bool = False) -> bytes:
        return _read_all(self.open_read(name, follow), limit)

    def list(self) -> list[str]:
        return sorted(os.listdir(self._fd))

    def is_current(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._id

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class PosixStorage:
    """The local file system, through ``os`` (see the module docstring)."""

    atomic_rename = True
    read_concurrency = 1

    def url(self, path: str) -> str:
        return path

    def norm(self, path: str) -> str:
        return os.path.abspath(path)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(path)

    def name(self, path: str) -> str:
        return os.path.basename(path)

    def kind(self, path: str) -> Kind:
        try:
            return _kind_of(os.lstat(path))
        except (FileNotFoundError, NotADirectoryError):
            return "missing"

    def size(self, path: str, follow: bool = True) -> int:
        r = _open_regular(path, path, follow)
        r.close()
        return r.size

    def open_read(self, path: str, follow: bool = True) -> _Reader:
        return _open_regular(path, path, follow)

    def read_small(self, path: str, limit: int, follow: bool = False) -> bytes:
        return _read_all(_open_regular(path, path, follow), limit)

    def open_write(self, path: str) -> _Writer:
        return _Writer(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk must not leave the temporary file behind
            raise

    def mkdir(self, path: str, parents: bool = False) -> None:
        if parents:
            os.makedirs(path, exist_ok=True)
        else:
            os.mkdir(path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def list(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def delete(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path)

    @contextlib.contextmanager
    def lock(self, folder: str) -> Iterator[None]:
        fd = os.open(folder, os.O_RDONLY)  # the folder itself is the lock: no lock file to leave behind
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def holder(self) -> dict:
        return process_holder()

    def holder_alive(self, holder: dict) -> bool:
        return holder_alive(holder)

    def open_dir(self, path: str) -> _PinnedDir:
        return _PinnedDir(path)
