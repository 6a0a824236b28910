"""`FileSystemReader`: torch DCP's ``storage_reader`` for a folder, as `load` takes it."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["FileSystemReader"]


class FileSystemReader:
    """``load(state, storage_reader=FileSystemReader(path))`` is ``load(state, path)``.

    DCP's constructor arguments (torch 2.13): ``path`` and ``_extension_registry`` (None only:
    shardwise data files have no stream transforms; anything else is a ``ValueError`` naming it).
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None) -> None:
        if _extension_registry is not None:
            raise ValueError("shardwise.checkpoint.FileSystemReader(_extension_registry=...): shardwise data files "
                             "are plain safetensors, checksummed; it has no stream transforms")
        self.path = path

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP's ``reset``: point the reader at ``checkpoint_id`` (when given)."""
        if checkpoint_id:
            self.path = checkpoint_id

    def __repr__(self) -> str:
        return f"FileSystemReader({os.fspath(self.path)!r})"
