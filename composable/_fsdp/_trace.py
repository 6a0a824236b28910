"""Profiler range names of one unit: what a trace of a training step shows.

Every collective phase of a unit runs inside a ``torch.profiler.record_function`` range named
``shardwise::<phase>[<unit>]``, where ``<unit>`` is the unit's module path under the root
(``layers.0``; ``root`` for the root itself; names joined by ``,`` for a unit over several
modules). The names are built once per unit (at the root's lazy init), never per call. See
"Reading a trace of one step" in ``docs/fully_shard.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TraceNames", "unit_name"]


@dataclass(frozen=True)
class TraceNames:
    all_gather: str  # issuing the all-gather (and building its input under mixed precision)
    all_gather_wait: str  # waiting for it to finish
    copy_out: str  # copying each parameter out of the gathered rows
    reduce_scatter: str  # writing gradients into the send buffer, issuing the reduce-scatter
    all_reduce: str  # issuing the all-reduce over the replicate axis (HSDP)

    @classmethod
    def for_unit(cls, unit: str) -> "TraceNames":
        return cls(*(f"shardwise::{phase}[{unit}]" for phase in
                     ("all_gather", "all_gather_wait", "copy_out", "reduce_scatter", "all_reduce")))


def unit_name(modules, paths: dict[int, str]) -> str:
    """``modules``' paths (``paths``: id(module) -> path under the root), ``root`` for ``""``."""
    return ",".join(paths.get(id(m), type(m).__name__) or "root" for m in modules)
