"""Profiler ranges of the checkpoint phases.

Each phase of a save or load runs inside one ``torch.profiler.record_function`` range named
``shardwise.checkpoint.<save|load>/<phase>``: one per phase and call (at most six per save and
four per load, about 30 us each without a profiler), never one per box or read. The names are
listed in ``docs/checkpoint.md`` ("Reading a profiler trace").
"""

from __future__ import annotations

from torch.profiler import record_function

__all__ = ["PREFIX", "phase"]

PREFIX = "shardwise.checkpoint."


def phase(name: str) -> record_function:
    """A context manager: the range ``shardwise.checkpoint.<name>`` (e.g. ``save/write``)."""
    return record_function(PREFIX + name)
