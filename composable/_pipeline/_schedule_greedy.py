"""Zero-bubble action lists built by a list scheduler over unit times (pure).

[Note: greedy zero-bubble lists]
`greedy_lists` plays all ranks forward in time, with ``F``, ``I`` and ``W`` one unit each. A
rank that is free takes, in this order: a ready ``I`` (the critical path: a rank upstream
waits for it; the latest stage first, then the oldest microbatch); a ready ``F`` while the
microbatch-stages it holds alive (``F`` done, ``W`` not yet: a split backward keeps its
activations until ``W``) are under its ``cap``; a pending ``W`` (the oldest first); else it
idles one unit. What each rank ran, in order, is its action list. Such a list comes from an
execution in which every action started after its dependencies ended, so the orders are
acyclic with the dependencies and the lists are deadlock-free under any timing (``simulate``
checks it too). The ``cap`` bounds each rank's peak activations (in microbatch-stages): ZBV's
is ``2 p`` (1F1B's ``p`` microbatches of the whole rank), interleaved ZB's that of interleaved
1F1B's list; with those, the weight gradients fill what 1F1B leaves idle.
"""

from __future__ import annotations

from collections.abc import Callable

from ._actions import Action, ActionKind
from ._placement import stage_rank

__all__ = ["greedy_lists"]


def greedy_lists(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int]) -> list[list[Action]]:
    """Every rank's action list ([Note: greedy zero-bubble lists]); ``cap(rank)`` >= ``v``."""
    S = pp * v
    stages = [[s for s in range(S) if stage_rank(s, pp, placement) == r] for r in range(pp)]
    done: dict[Action, int] = {}  # action -> end time
    lists: list[list[Action]] = [[] for _ in range(pp)]
    next_f = {s: 0 for s in range(S)}  # next microbatch to forward on stage s
    next_i = {s: 0 for s in range(S)}
    pending_w: list[list[Action]] = [[] for _ in range(pp)]
    alive = [0] * pp
    free_at = [0] * pp
    total, t = 3 * S * m, 0
    while len(done) < total:
        progressed = False
        for r in range(pp):
            if free_at[r] > t:
                continue
            a = _pick(r, t, stages[r], S, m, done, next_f, next_i, pending_w[r], alive[r] < cap(r))
            if a is None:
                continue
            progressed = True
            lists[r].append(a)
            done[a] = t + 1
            free_at[r] = t + 1
            if a.kind is ActionKind.F:
                next_f[a.stage] += 1
                alive[r] += 1
            elif a.kind is ActionKind.I:
                next_i[a.stage] += 1
                pending_w[r].append(Action(ActionKind.W, a.stage, a.microbatch))
            else:
                pending_w[r].remove(a)
                alive[r] -= 1
        if not progressed and all(f <= t for f in free_at) and not any(d > t for d in done.values()):
            raise ValueError(f"pipeline: greedy schedule stuck at pp={pp}, m={m}, v={v}; raise the cap")
        t += 1
    return lists


def _ready(deps: list[Action], done: dict[Action, int], t: int) -> bool:
    return all(done.get(d, t + 1) <= t for d in deps)


def _pick(r, t, mine, S, m, done, next_f, next_i, pending_w, may_forward):
    best = None
    for s in sorted(mine, reverse=True):  # I: the latest stage first
        i = next_i[s]
        if i < m:
            deps = [Action(ActionKind.F, s, i)] + ([Action(ActionKind.I, s + 1, i)] if s + 1 < S else [])
            if _ready(deps, done, t) and (best is None or i < best.microbatch):
                best = Action(ActionKind.I, s, i)
    if best is not None:
        return best
    if may_forward:
        for s in sorted(mine, reverse=True):  # F: the latest stage first (its backward comes sooner)
            i = next_f[s]
            if i < m and (s == 0 or _ready([Action(ActionKind.F, s - 1, i)], done, t)):
                if best is None or i < best.microbatch:
                    best = Action(ActionKind.F, s, i)
        if best is not None:
            return best
    return pending_w[0] if pending_w else None
