"""The checkpoint package's exception type (a leaf module: it imports nothing of the package,
so any module may raise it without depending on the communication layer)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or read.

    In collective calls it is raised on every rank with the same message, which names the
    ranks that found a problem, the tensor and the file concerned, and what to do about it.
    """
