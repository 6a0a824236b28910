"""`FileSystemWriter`: torch DCP's ``storage_writer`` for a folder, as `save` takes it."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["FileSystemWriter"]


def _format_name(value: Any) -> str:
    return str(getattr(value, "name", value)).upper()


class FileSystemWriter:
    """``save(state, storage_writer=FileSystemWriter(path))`` is ``save(state, path)``.

    DCP's constructor arguments (torch 2.13): ``single_file_per_rank`` (True: one data file per
    rank, what shardwise always writes; False is refused), ``sync_files`` (accepted; files are
    always synced, the atomic commit needs it), ``thread_count`` and ``per_thread_copy_ahead``
    (accepted and unused: each rank streams its file in one thread), ``cache_staged_state_dict``
    (accepted and unused: ``async_save`` copies the state to CPU memory anew each time),
    ``overwrite`` (True: a save replaces the checkpoint at ``path``; False is refused),
    ``_extensions`` (None only) and ``serialization_format`` (``TORCH_SAVE`` or
    ``SAFETENSORS``: both mean shardwise's safetensors format). A refusal is a ``ValueError``
    naming the argument.
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True, _extensions: Any = None,
                 serialization_format: Any = "TORCH_SAVE") -> None:
        refused = {"single_file_per_rank": (single_file_per_rank is not True, "shardwise writes one file per rank"),
                   "overwrite": (overwrite is not True, "a shardwise save replaces the checkpoint at its path "
                                 "atomically; check for it yourself (os.path.exists) to keep an old one"),
                   "_extensions": (_extensions is not None, "shardwise data files are plain safetensors, checksummed; "
                                   "it has no stream transforms"),
                   "serialization_format": (_format_name(serialization_format) not in ("TORCH_SAVE", "SAFETENSORS"),
                                            "shardwise writes safetensors")}
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"shardwise.checkpoint.FileSystemWriter({name}=...): {why}")
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"shardwise.checkpoint.FileSystemWriter(thread_count=...) must be an int >= 1, got "
                             f"{thread_count!r}")
        self.path = path
        self.sync_files, self.thread_count, self.per_thread_copy_ahead = sync_files, thread_count, per_thread_copy_ahead
        self.cache_staged_state_dict, self.overwrite = cache_staged_state_dict, overwrite

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """DCP's ``reset``: point the writer at ``checkpoint_id`` (when given)."""
        if checkpoint_id:
            self.path = checkpoint_id

    def __repr__(self) -> str:
        return f"FileSystemWriter({os.fspath(self.path)!r})"
