"""Zero-bubble action lists built by a list scheduler, over unit or measured times (pure).

[Note: greedy zero-bubble lists]
`greedy_lists` plays all ranks forward in time. A rank that is free takes, by default in this
order (``prefer="IFW"``): a ready ``I`` (the critical path: a rank upstream waits for it; the
oldest microbatch first, then the latest stage); a ready ``F`` while the microbatch-stages it
holds alive (``F`` done, ``W`` not yet: a split backward keeps its activations until ``W``) are
under its ``cap`` (the latest stage first, then the oldest microbatch); a pending ``W`` (the oldest
first); else it waits until some action ends. What each rank ran, in order, is its action list.
Such a list comes from an execution in which every action started after its dependencies ended,
so the orders are acyclic with the dependencies and the lists are deadlock-free under any timing
(``simulate`` checks it too). The ``cap`` bounds each rank's peak activations (in
microbatch-stages): ZBV's is ``2 p`` (1F1B's ``p`` microbatches of the whole rank), interleaved
ZB's that of interleaved 1F1B's list; with those, the weight gradients fill what 1F1B leaves idle.

With ``costs`` (seconds per ``(kind, stage)``, as `simulate` takes them) the play uses those
durations instead of one unit each, and a message between ranks arrives ``comm_time`` after the
action that sends it; the lists then fit the measured times ([Note: schedules tuned to measured
costs] in ``_schedule_tuned.py``). Without them every action takes one unit and messages none.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from ._actions import Action, ActionKind
from ._placement import stage_rank

__all__ = ["PREFERENCES", "greedy_lists"]

PREFERENCES = ("IFW", "IWF", "FIW")
"""The orders of preference among ready kinds tried by `tune_schedule` and by the registered
``zbv`` / ``interleaved_zb`` lists ([Note: greedy zero-bubble lists])."""


def greedy_lists(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int], *,
                 costs: Mapping[tuple[str, int], float] | None = None, comm_time: float = 0.0,
                 prefer: str = "IFW", reserve: bool = False) -> list[list[Action]]:
    """Every rank's action list ([Note: greedy zero-bubble lists]); ``cap(rank)`` >= ``v``;
    ``prefer``: the order in which a free rank considers the kinds, a permutation of ``"IFW"``;
    ``reserve``: a forward on one of a rank's stages leaves one slot under the cap for each of
    the rank's later stages (so the oldest microbatch can always go on; without it, measured
    times can fill the cap with first-stage forwards and stall: ValueError)."""
    if sorted(prefer) != ["F", "I", "W"]:
        raise ValueError(f"pipeline: prefer={prefer!r}; it must order the letters I, F and W (e.g. 'IFW')")
    S = pp * v
    where = [stage_rank(s, pp, placement) for s in range(S)]
    stages = [[s for s in range(S) if where[s] == r] for r in range(pp)]
    later = {s: sum(1 for u in stages[where[s]] if u > s) for s in range(S)}  # the rank's stages after s

    def cost(kind: ActionKind, s: int) -> float:
        return 1.0 if costs is None else float(costs.get((kind.value, s), 1.0))

    done: dict[Action, float] = {}  # action -> when its result is usable on its own rank
    lists: list[list[Action]] = [[] for _ in range(pp)]
    next_f = {s: 0 for s in range(S)}  # next microbatch to forward on stage s
    next_i = {s: 0 for s in range(S)}
    pending_w: list[list[Action]] = [[] for _ in range(pp)]
    alive = [0] * pp
    free_at = [0.0] * pp
    times = [0.0]  # a heap of the instants at which something may become ready
    total, count = 3 * S * m, 0

    def ready(r: int, deps: list[Action], t: float) -> bool:
        for d in deps:
            end = done.get(d)
            if end is None or end + (comm_time if where[d.stage] != r else 0.0) > t:
                return False
        return True

    while count < total:
        if not times:
            raise ValueError(f"pipeline: greedy schedule stuck at pp={pp}, m={m}, v={v}; raise the cap")
        t = heapq.heappop(times)
        while times and times[0] <= t:
            heapq.heappop(times)
        for r in range(pp):
            if free_at[r] > t:
                continue
            room = cap(r) - alive[r]
            may = (lambda s, r=r, room=room: room > later[s]) if reserve else (lambda s, room=room: room > 0)
            a = _pick(r, t, stages[r], S, m, next_f, next_i, pending_w[r], may, prefer, ready)
            if a is None:
                continue
            lists[r].append(a)
            end = t + cost(a.kind, a.stage)
            done[a] = free_at[r] = end
            count += 1
            heapq.heappush(times, end)
            if comm_time:
                heapq.heappush(times, end + comm_time)
            if a.kind is ActionKind.F:
                next_f[a.stage] += 1
                alive[r] += 1
            elif a.kind is ActionKind.I:
                next_i[a.stage] += 1
                pending_w[r].append(Action(ActionKind.W, a.stage, a.microbatch))
            else:
                pending_w[r].remove(a)
                alive[r] -= 1
    return lists


def _pick(r: int, t: float, mine: list[int], S: int, m: int, next_f: dict[int, int], next_i: dict[int, int],
          pending_w: list[Action], may_forward: Callable[[int], bool], prefer: str,
          ready: Callable[[int, list[Action], float], bool]) -> Action | None:
    for kind in prefer:
        best: Action | None = None
        if kind == "I":
            for s in sorted(mine, reverse=True):  # the latest stage first, then the oldest microbatch
                i = next_i[s]
                if i < m:
                    deps = [Action(ActionKind.F, s, i)] + ([Action(ActionKind.I, s + 1, i)] if s + 1 < S else [])
                    if ready(r, deps, t) and (best is None or i < best.microbatch):
                        best = Action(ActionKind.I, s, i)
        elif kind == "F":
            for s in sorted(mine, reverse=True):  # the latest stage first (its backward comes sooner)
                i = next_f[s]
                if i < m and may_forward(s) and (s == 0 or ready(r, [Action(ActionKind.F, s - 1, i)], t)):
                    if best is None or i < best.microbatch:
                        best = Action(ActionKind.F, s, i)
        else:
            best = pending_w[0] if pending_w else None
        if best is not None:
            return best
    return None
