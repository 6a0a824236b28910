"""`AgreedPlan`: what a save's agreement decided, kept so that the next save of the same state
reuses it after one small collective.

[Note: reusing a save's agreement]
A save's planning is collective (``_save_plan.keep_own_pieces``): rank 0 gathers every rank's
boxes and names each box's writer ([Note: one writer per box over the world] in
``checkpoint/_geometry/_owners.py``), then gathers every rank's plain value digests and decides
which are shared ([Note: plain values per rank] in ``_save_plan.py``); the commit gathers every
rank's boxes again, with their checksums, for the index. A training job saves the same state,
laid out the same way, every few hundred steps, and the answers do not change: so each rank
keeps them on the process group the agreement ran on (`lookup` / `remember` take it; None for a
process alone), keyed by a *fingerprint* of everything they depend on from this rank: the world
size and this rank, the digest of the tensors' keys, dtypes, shapes and layouts, the boxes this
rank holds and may write (in order), and the keys of its plain values and ``bytes`` values.
Rank 0 also keeps, per rank, the geometry of the boxes each rank wrote (the *skeleton*, taken
from the full reports of the save that built the index).

A later save looks its fingerprint up and takes part in one all-reduce
(``_comm.agree_values``) of the agreement's *generation* (a random number rank 0 drew for it;
rank 0 adds whether it holds the skeleton). The plan is reused only when every rank found an
entry of the same generation: every rank's inputs are then exactly those the agreement
decided on, so its decision holds. Anything else (a rank without an entry: a new process, a
changed tensor, shape, dtype, layout or set of keys, another world size, rank 0 without the
skeleton) gives differing texts, and every rank runs the full agreement. With the plan reused:

* each rank keeps the boxes it was told to write (no gather, no scatter);
* the plain values: one more all-reduce of the digests of the keys every rank holds
  (``common``), in a fixed order, tells which of them are equal everywhere (shared); every
  other key is per rank, as the full agreement would decide;
* each rank's report for the index carries only its checksums, in the order of its boxes,
  and rank 0 puts them on the skeleton (``_save_plan.build_index``), counting them against it.

The data written is always the state of this save: the plan only says which of its own boxes a
rank writes and under which names. A stale plan can therefore not write wrong data, and is
never used: any change to what it was decided from is a different fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgreedPlan", "fingerprint", "lookup", "remember"]

_KEEP = 4  # agreements kept per group (a job may save a few different states in turn)


class _Alone:
    """The key of a process saving on its own (no process group)."""


_ALONE = _Alone()
_PLANS: weakref.WeakKeyDictionary[Any, OrderedDict[str, AgreedPlan]] = weakref.WeakKeyDictionary()  # by group
_LOCK = threading.Lock()


@dataclass
class AgreedPlan:
    """One rank's record of an agreement (see [Note: reusing a save's agreement])."""

    generation: int  # drawn by rank 0; the same on every rank of the agreement
    writes: frozenset[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (key, offsets, sizes) this rank writes
    common: dict[str, list[str]]  # "v"/"b" -> plain keys every rank holds, sorted
    skeleton: list[list[Any]] | None = field(default=None)  # rank 0: per rank, its boxes' geometry


def fingerprint(world: int, rank: int, meta_digest: str, held: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                value_keys: list[str], blob_keys: list[str]) -> str:
    """The key of this rank's inputs to an agreement."""
    body = json.dumps([world, rank, meta_digest, held, sorted(value_keys), sorted(blob_keys)], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def lookup(group: Any, fp: str) -> AgreedPlan | None:
    """The agreement kept on ``group`` (None: this process alone) for fingerprint ``fp``."""
    with _LOCK:
        plans = _PLANS.get(_ALONE if group is None else group)
        if plans is None or fp not in plans:
            return None
        plans.move_to_end(fp)
        return plans[fp]


def remember(group: Any, fp: str, plan: AgreedPlan) -> None:
    with _LOCK:
        plans = _PLANS.setdefault(_ALONE if group is None else group, OrderedDict())
        plans[fp] = plan
        plans.move_to_end(fp)
        while len(plans) > _KEEP:
            plans.popitem(last=False)

