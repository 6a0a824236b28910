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

[Note: the play's events]
The play is defined instant by instant: at each instant at which something ends, every free rank
in rank order picks. Examining every rank at every instant made a play cost ``O(p x instants)``
picks (29-53 s for ``interleaved_zb`` at p=32, m=32, v=4). What a free rank can pick depends only
on its own state, which changes only when it acts, and on when the results it waits for arrive:
the ``F`` of the stage before (for its ``F``) and the ``I`` of the stage after (for its ``I``). So a
rank that finds nothing records the earliest arrival among the results it waits for that are
already under way (``wake``); a rank that starts such a result lowers the ``wake`` of the one rank
that waits for it; a rank is examined only at an instant at or after both ``free_at`` and
``wake`` (a heap of those instants). Examinations that are skipped are exactly those that would
find nothing, and the ranks examined at one instant still go in rank order, including one made
ready in that pass by an action that takes no time (a later rank joins the pass, an earlier one
the next pass at the same instant, as before): the lists are the same as the instant-by-instant
play's, at ``O(actions log p)``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping

from ._actions import Action, ActionKind
from ._placement import stage_rank

__all__ = ["PREFERENCES", "greedy_lists", "greedy_plays"]

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
    times can fill the cap with first-stage forwards and stall: ValueError). Cost: see [Note:
    the play's events]."""
    _check_prefer(prefer)
    return _play(pp, m, v, placement, cap, costs, comm_time, prefer, reserve)[0]


def greedy_plays(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int], *,
                 costs: Mapping[tuple[str, int], float] | None = None, comm_time: float = 0.0,
                 prefer: str = "IFW") -> list[list[list[Action]]]:
    """``[greedy_lists(..., reserve=False), greedy_lists(..., reserve=True)]`` without the plays
    that stall; when ``reserve`` changed none of the first's decisions the second is not played
    again (it would make the same lists): it is the same list object as the first."""
    _check_prefer(prefer)
    plays: list[list[list[Action]]] = []
    try:
        lists, reserve_mattered = _play(pp, m, v, placement, cap, costs, comm_time, prefer, False)
        plays.append(lists)
        if not reserve_mattered:
            return [lists, lists]
    except ValueError:  # stalled under the cap
        pass
    try:
        plays.append(_play(pp, m, v, placement, cap, costs, comm_time, prefer, True)[0])
    except ValueError:
        pass
    return plays


def _check_prefer(prefer: str) -> None:
    if sorted(prefer) != ["F", "I", "W"]:
        raise ValueError(f"pipeline: prefer={prefer!r}; it must order the letters I, F and W (e.g. 'IFW')")


def _play(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int],
          costs: Mapping[tuple[str, int], float] | None, comm_time: float, prefer: str,
          reserve: bool) -> tuple[list[list[Action]], bool]:
    """`greedy_lists`, and whether ``reserve`` would have changed what some free rank could
    forward (if not, the play with the other ``reserve`` is the same)."""
    S = pp * v
    where = [stage_rank(s, pp, placement) for s in range(S)]
    mine = [sorted((s for s in range(S) if where[s] == r), reverse=True) for r in range(pp)]  # latest first
    later = [sum(1 for u in mine[where[s]] if u > s) for s in range(S)]  # the rank's stages after s
    caps = [cap(r) for r in range(pp)]
    dur = {k: [1.0 if costs is None else float(costs.get((k, s), 1.0)) for s in range(S)] for k in "FIW"}
    inf = float("inf")
    done_f = [[inf] * m for _ in range(S)]  # when F(s, i) ends (inf: not started)
    done_i = [[inf] * m for _ in range(S)]
    next_f, next_i = [0] * S, [0] * S  # next microbatch to forward / to I on stage s
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    alive, free_at, wake = [0] * pp, [0.0] * pp, [-inf] * pp
    lists: list[list[Action]] = [[] for _ in range(pp)]
    due = [(0.0, r) for r in range(pp)]  # (when rank r is checked next, r)
    total, count = 3 * S * m, 0
    kinds = {k.value: k for k in ActionKind}
    mattered = [False]

    after_f = [comm_time if s and where[s - 1] != where[s] else 0.0 for s in range(S)]  # F(s-1) -> F(s)
    after_i = [comm_time if s + 1 < S and where[s + 1] != where[s] else 0.0 for s in range(S)]  # I(s+1) -> I(s)
    last_stage = S - 1

    def pick(r: int, t: float) -> tuple[str, int, int] | float:
        """Rank ``r``'s action at ``t`` as ``(kind, stage, microbatch)``, or, with none ready, the
        earliest instant at which one of its waits may end (inf: only when another rank acts)."""
        soonest = inf
        for kind in prefer:
            best = None
            if kind == "I":
                for s in mine[r]:
                    i = next_i[s]
                    if i < m and (best is None or i < best[2]):
                        ready = done_f[s][i]  # inf until run
                        if s < last_stage:
                            ready = max(ready, done_i[s + 1][i] + after_i[s])
                        if ready <= t:
                            best = ("I", s, i)
                        elif ready < soonest:
                            soonest = ready
            elif kind == "F":
                room = caps[r] - alive[r]
                for s in mine[r]:
                    i = next_f[s]
                    if i < m and 0 < room <= later[s]:
                        mattered[0] = True  # room for s without reserve, none with it
                    if i < m and (room > later[s] if reserve else room > 0) and (best is None or i < best[2]):
                        ready = done_f[s - 1][i] + after_f[s] if s else 0.0
                        if ready <= t:
                            best = ("F", s, i)
                        elif ready < soonest:
                            soonest = ready
            elif pending_w[r]:
                s, i = pending_w[r][0]
                best = ("W", s, i)
            if best is not None:
                return best
        return soonest

    def watch(r: int, ready: float) -> None:
        """A result rank ``r`` may wait for is usable from ``ready``: check ``r`` then."""
        if ready < wake[r]:
            wake[r] = ready
            heapq.heappush(due, (max(free_at[r], ready), r))

    while count < total:
        if not due:
            raise ValueError(f"pipeline: greedy schedule stuck at pp={pp}, m={m}, v={v}; raise the cap")
        t = due[0][0]
        sweep: list[int] = []  # the ranks checked at t, in rank order (one pass of every rank)
        while due and due[0][0] <= t:
            _, r = heapq.heappop(due)
            if max(free_at[r], wake[r]) <= t and r not in sweep:
                heapq.heappush(sweep, r)
        last = -1
        while sweep:
            r = heapq.heappop(sweep)
            last = r
            got = pick(r, t)
            if isinstance(got, float):
                wake[r] = got
                if got < inf:
                    heapq.heappush(due, (max(free_at[r], got), r))
                continue
            kind, s, i = got
            lists[r].append(Action(kinds[kind], s, i))
            end = t + dur[kind][s]
            free_at[r], wake[r] = end, -inf
            heapq.heappush(due, (end, r))
            count += 1
            woken = []
            if kind == "F":
                done_f[s][i] = end
                next_f[s] += 1
                alive[r] += 1
                if s + 1 < S:
                    woken.append(where[s + 1])
            elif kind == "I":
                done_i[s][i] = end
                next_i[s] += 1
                pending_w[r].append((s, i))
                if s:
                    woken.append(where[s - 1])
            else:
                pending_w[r].popleft()
                alive[r] -= 1
            for q in woken:
                ready = end + (comm_time if q != r else 0.0)
                if q != r and ready < wake[q]:
                    watch(q, ready)
                    if ready <= t and free_at[q] <= t and q > last and q not in sweep:
                        heapq.heappush(sweep, q)  # still in this pass of the ranks
    return lists, mattered[0]
