"""Where checkpoint files live: the `Storage` protocol and its implementations.

`storage_for` picks one for a path or URL: a plain path is the local file system
(`PosixStorage`); ``<protocol>://...`` goes through fsspec (`FsspecStorage`), as does any
path when a storage is passed explicitly. The semantics every storage must provide are
[Note: storage semantics] in ``_protocol.py``.
"""

from __future__ import annotations

import os

from ._fsspec import FsspecStorage
from ._protocol import DirView, Kind, ReadHandle, Storage, WriteHandle
from ._posix import PosixStorage

__all__ = ["DirView", "FsspecStorage", "Kind", "PosixStorage", "ReadHandle", "Storage", "WriteHandle",
           "storage_for"]

def storage_for(path: str | os.PathLike, storage: Storage | None = None) -> tuple[Storage, str]:
    """The storage holding ``path`` and ``path`` in its canonical form: ``storage`` when given;
    fsspec for a URL (``memory://run/step-1``, ``s3://bucket/ckpt``, ``file:///tmp/x``); else the
    local file system."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"a checkpoint path must be a str or os.PathLike of str, got {type(text).__name__}")
    if storage is not None:
        return storage, storage.norm(text)
    if "://" in text:
        return FsspecStorage.from_url(text)
    posix = PosixStorage()
    return posix, posix.norm(text)
