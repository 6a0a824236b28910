"""The small shared pieces of the fully_shard wing: the error it raises where FSDP2 raises
``AssertionError``, the two state machines of a unit (`TrainingState`: what it is doing,
checked by ``FSDPState``; `ShardState`: where its parameters are, checked by ``ParamGroup``),
the mark an adopted parameter carries, and the profiler range names of a unit.

[Note: profiler range names]
Every collective phase of a unit runs inside a ``torch.profiler.record_function`` range named
``shardwise::<phase>[<unit>]``, where ``<unit>`` is the unit's module path under the root
(``layers.0``; ``root`` for the root itself; names joined by ``,`` for a unit over several
modules). The names are built once per unit (at the root's lazy init), never per call. See
"Reading a trace of one step" in ``docs/fully_shard.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

__all__ = ["FullyShardUsageError", "TrainingState", "TRAINING_NEXT", "ShardState", "SHARD_NEXT", "OWNER_ATTR",
           "TraceNames", "unit_name", "ParamEntry"]

OWNER_ATTR = "_shardwise_sharded_as"  # set on an original parameter once a unit took it

# one parameter a unit takes: (fqn, parameter, every (module, attribute) that holds it)
ParamEntry = tuple[str, torch.Tensor, list[tuple[nn.Module, str]]]


class FullyShardUsageError(ValueError, AssertionError):
    """A call of ``fully_shard`` that FSDP2 refuses with an ``AssertionError``: applying it twice
    to the same module, or a ``shard_placement_fn`` returning ``Shard(d)`` with ``d`` outside the
    parameter's dims. Both a ``ValueError`` (bad input, as shardwise reports it) and an
    ``AssertionError`` (what code written for FSDP2 catches)."""


class TrainingState(Enum):
    """What a unit is doing. IDLE -> FORWARD (pre-forward) -> IDLE (post-forward) ...
    -> BACKWARD (first pre-backward) -> IDLE (the root's end-of-backward callback). A forward
    in BACKWARD is a recomputation (activation checkpointing) and changes nothing."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


TRAINING_NEXT = {
    TrainingState.IDLE: (TrainingState.FORWARD, TrainingState.BACKWARD),
    # FORWARD -> FORWARD: a unit over several modules, or a module run again before its
    # post-forward (e.g. after an exception); FORWARD -> BACKWARD: backward inside a forward
    TrainingState.FORWARD: (TrainingState.FORWARD, TrainingState.IDLE, TrainingState.BACKWARD),
    TrainingState.BACKWARD: (TrainingState.BACKWARD, TrainingState.IDLE),
}


class ShardState(Enum):
    """Where a unit's parameters are. Transitions (checked):

    SHARDED -> GATHERING (``unshard``: all-gather issued) -> UNSHARDED (``wait_unshard``) ->
    SHARDED or SHARDED_POST_FORWARD (``reshard``); SHARDED_POST_FORWARD -> GATHERING (the
    cheaper all-gather over the smaller group) or -> SHARDED (the kept rows dropped)."""

    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"  # sharded, plus 1/k of the rows kept
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


SHARD_NEXT = {
    ShardState.SHARDED: (ShardState.GATHERING,),
    ShardState.SHARDED_POST_FORWARD: (ShardState.GATHERING, ShardState.SHARDED),
    ShardState.GATHERING: (ShardState.UNSHARDED,),
    ShardState.UNSHARDED: (ShardState.SHARDED, ShardState.SHARDED_POST_FORWARD),
}


@dataclass(frozen=True)
class TraceNames:
    """The profiler range names of one unit ([Note: profiler range names])."""

    all_gather: str  # issuing the all-gather (and building its input under mixed precision)
    all_gather_wait: str  # waiting for it to finish
    copy_out: str  # copying each parameter out of the gathered rows
    reduce_scatter: str  # writing gradients into the send buffer, issuing the reduce-scatter
    all_reduce: str  # issuing the all-reduce over the replicate axis (HSDP)

    @classmethod
    def for_unit(cls, unit: str) -> TraceNames:
        return cls(*(f"shardwise::{phase}[{unit}]" for phase in
                     ("all_gather", "all_gather_wait", "copy_out", "reduce_scatter", "all_reduce")))


def unit_name(modules: Iterable[nn.Module], paths: dict[int, str]) -> str:
    """``modules``' paths (``paths``: id(module) -> path under the root), ``root`` for ``""``."""
    return ",".join(paths.get(id(m), type(m).__name__) or "root" for m in modules)
