"""`AgreedPlan`: what a save's agreement decided, kept so that the next save of the same state
reuses it after one small collective.

[Note: reusing a save's agreement]
A save's planning is collective (``_save_plan.keep_own_pieces``): rank 0 names each box's writer
([Note: one writer per box over the world] in ``checkpoint/_geometry/_owners.py``) and decides
which plain values are shared ([Note: plain values per rank] in ``_save_plan.py``); the commit
gathers every rank's boxes again, with checksums, for the index. A job saves the same state
every few hundred steps and the answers do not change, so each rank keeps them per process
group (`lookup` / `remember`; None for a process alone), keyed by a *fingerprint* of all they
depend on from this rank: world size and rank, the digest of the tensors' keys, dtypes, shapes
and layouts, the boxes it holds and may write (in order), and the keys of its plain and
``bytes`` values. Rank 0 also keeps each rank's box geometry (the *skeleton* of the index).

A later save looks its fingerprint up and all-reduces (``_comm.agree_values``) the agreement's
*generation* (a random number rank 0 drew; rank 0 adds whether it holds the skeleton). The plan
is reused only when every rank found an entry of the same generation; anything else runs the
full agreement on every rank. With the plan reused:

* each rank keeps the boxes it was told to write (no gather, no scatter);
* one more all-reduce of the digests of the plain values every rank holds (``common``) tells
  which are equal everywhere (shared); the rest are per rank;
* each rank's report carries only its checksums, in box order, and rank 0 puts them on the
  skeleton (``_save_plan.build_index``).

The data written is always this save's: the plan only says which boxes a rank writes under
which names, and any change to what it was decided from is a different fingerprint.
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

