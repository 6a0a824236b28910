"""The checkpoint package's exception type (a leaf module: it imports nothing of the package,
so any module may raise it without depending on the communication layer)."""

from __future__ import annotations

__all__ = ["CheckpointError", "IndexMissing"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or read.

    In collective calls it is raised on every rank with the same message, which names the
    ranks that found a problem, the tensor and the file concerned, and what to do about it.
    """


class IndexMissing(CheckpointError):
    """The directory has no ``index.json`` (or is not there): not a checkpoint, or not at this
    instant, while a save renames one into place. A load opening it retries when the index is
    there once it looks again (`_open_source` in ``checkpoint/_load/_reader.py``)."""
