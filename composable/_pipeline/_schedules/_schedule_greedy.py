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
play's, at ``O(actions log p)``. The play records each action as an integer key (`simulate`'s)
in the order it ran them, each after what it waits for: `played_makespans` times the lists in
that order without checking or ordering them again, and `played_lists` makes the ``Action`` s.

[Note: plays that fork]
Plays that differ only in ``prefer`` or ``reserve`` make the same decisions up to the first pick
at which one of them would take another action; up to there their states are the same. A play
asked to watch other preferences (``forks``, without reserve) therefore checks, at each pick,
whether one of them would take another kind: a kind it prefers to the one taken and that has an
action ready (kinds this play prefers to the one taken had none). ``reserve`` changes a decision
exactly when the play takes a forward that reserve would have refused (``room <= later[s]``; a
forward it allows is also the one reserve takes, and a rank that finds nothing finds nothing with
reserve either); so a play watching ``reserve_forks`` forks them there, as long as their own
preference has not forked (then that play watches its reserve). At such a pick the state is
copied (`_state`) and the other play goes on from it (``start``): its lists are those it would
make from the beginning. ``wake`` instants copied from a play without reserve are no later than
its own would be, so the play with reserve examines a rank no less often than it needs (an
examination that finds nothing changes nothing). A play cut short by its limit cuts short the
plays that had not forked yet: their lists begin with the same actions.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
    return played_lists(_play(pp, m, v, placement, cap, costs, comm_time, prefer, reserve)[0], pp, m, v, placement)


def greedy_plays(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int], *,
                 costs: Mapping[tuple[str, int], float] | None = None, comm_time: float = 0.0,
                 prefer: str = "IFW") -> list[list[list[Action]]]:
    """``[greedy_lists(..., reserve=False), greedy_lists(..., reserve=True)]`` without the plays
    that stall; when ``reserve`` changed none of the first's decisions the second is not played
    again (it would make the same lists): it is the same list object as the first."""
    _check_prefer(prefer)
    plays: list[list[list[Action]]] = []
    try:
        keys, reserve_mattered, _, _ = _play(pp, m, v, placement, cap, costs, comm_time, prefer, False)
        lists = played_lists(keys, pp, m, v, placement)
        plays.append(lists)
        if not reserve_mattered:
            return [lists, lists]
    except ValueError:  # stalled under the cap
        pass
    try:
        plays.append(played_lists(_play(pp, m, v, placement, cap, costs, comm_time, prefer, True)[0], pp, m, v,
                                  placement))
    except ValueError:
        pass
    return plays


def _check_prefer(prefer: str) -> None:
    if sorted(prefer) != ["F", "I", "W"]:
        raise ValueError(f"pipeline: prefer={prefer!r}; it must order the letters I, F and W (e.g. 'IFW')")


def played_lists(keys: list[int] | None, pp: int, m: int, v: int, placement: str) -> list[list[Action]]:
    """Every rank's list of the actions of a play, from the keys `_play` gives in the order it
    ran them (``(code * S + stage) * m + microbatch``, code 0 for F, 2 for I, 3 for W: `_simulate`'s keys)."""
    assert keys is not None, "a play cut short has no lists"
    S = pp * v
    where = [stage_rank(s, pp, placement) for s in range(S)]
    lists: list[list[Action]] = [[] for _ in range(pp)]
    kinds = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
    make = Action.checked_already
    for key in keys:
        c, rest = divmod(key, S * m)
        s, i = divmod(rest, m)
        lists[where[s]].append(make(kinds[c], s, i))
    return lists


Fork = tuple[str, bool]
"""A play's ``(prefer, reserve)``."""

State = list[Any]
"""A play's state between two picks (`_play`'s locals, copied), from which another play that made
the same decisions so far goes on: [Note: plays that fork]."""


def _play(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int],
          costs: Mapping[tuple[str, int], float] | None, comm_time: float, prefer: str,
          reserve: bool, limit: float | None = None, *, forks: Sequence[str] = (),
          reserve_forks: Sequence[str] = (), start: State | None = None
          ) -> tuple[list[int] | None, bool, float, dict[Fork, State]]:
    """The play of `greedy_lists` as the keys of its actions in the order it ran them (every
    action after those it waits for: an order `simulate` may run them in, see `played_makespans`
    in ``_simulate.py``); whether ``reserve`` changed one of its decisions (if not, the play with
    the other ``reserve`` is the same); with ``limit``, the lists' makespan at unit times
    (`simulate` with one unit per action), or ``None`` keys once that is sure to exceed
    ``limit`` or the play stalls (it is cut short there: [Note: building the registered lists]
    in ``_schedule_zbv.py``); and the states at which the plays of ``forks`` (other preferences,
    without reserve) and of ``reserve_forks`` (preferences with reserve) first decide otherwise
    ([Note: plays that fork]; ``start``: go on from such a state). Without ``limit``, ValueError
    if the play stalls under the cap."""
    S = pp * v
    n = S * m
    F, I, W = 0, 2 * n, 3 * n  # key offsets of the kinds
    where = [stage_rank(s, pp, placement) for s in range(S)]
    mine = [sorted((s for s in range(S) if where[s] == r), reverse=True) for r in range(pp)]  # latest first
    later = [sum(1 for u in mine[where[s]] if u > s) for s in range(S)]  # the rank's stages after s
    caps = [cap(r) for r in range(pp)]
    dur = {k: [1.0 if costs is None else float(costs.get((k, s), 1.0)) for s in range(S)] for k in "FIW"}
    dur_f, dur_i, dur_w = dur["F"], dur["I"], dur["W"]
    inf = float("inf")
    after_f = [comm_time if s and where[s - 1] != where[s] else 0.0 for s in range(S)]  # F(s-1) -> F(s)
    after_i = [comm_time if s + 1 < S and where[s + 1] != where[s] else 0.0 for s in range(S)]  # I(s+1) -> I(s)
    last_stage = S - 1
    codes = {"I": 0, "F": 1, "W": 2}
    order = [codes[k] for k in prefer]
    if start is None:
        start = [
            0.0, [], -1,  # the instant, the ranks still to check at it (a heap), the last one checked
            # when F(s, i) / I(s, i) ends, at s * m + i (inf: not started); F of "stage -1" (at n + i,
            # index -m + i) at 0, I of "stage S" at -inf: what the first / last stage waits for
            [inf] * n + [0.0] * m, [inf] * n + [-inf] * m,
            [0] * S, [0] * S,  # next microbatch to forward / to I on stage s
            [deque() for _ in range(pp)],  # per rank, s * m + i of the I's whose W is due
            [0] * pp, [0.0] * pp, [-inf] * pp, [False] * pp,  # alive, free_at, wake, in the sweep
            [],  # the keys so far
            [(0.0, r) for r in range(pp)],  # (when rank r is checked next, r): a heap
            [0] * n, [0] * n, [0] * pp,  # at unit times: when F(s, i) / I(s, i) ends, each rank's clock
            [3 * len(mine[r]) * m for r in range(pp)],  # the actions each rank has still to run
            False]  # reserve mattered
    (t, sweep, last, done_f, done_i, next_f, next_i, pending_w, alive, free_at, wake, in_sweep, keys, due,
     unit_f, unit_i, unit_clock, left, mattered) = start
    track = limit is not None
    bound = inf if limit is None else limit
    watch = [p for p in forks if p != prefer]
    orders = {p: [codes[k] for k in p] for p in watch}
    assert not (watch and reserve), "a play with reserve forks no other preference"
    watch_reserve = list(reserve_forks)
    forked: dict[Fork, State] = {}
    total = 3 * n
    heappush, heappop = heapq.heappush, heapq.heappop

    while len(keys) < total:
        if not sweep:
            if not due:
                if track:
                    return None, mattered, inf, forked
                raise ValueError(f"pipeline: greedy schedule stuck at pp={pp}, m={m}, v={v}; raise the cap")
            t = due[0][0]  # the next instant: the ranks checked at it, in rank order (one pass of every rank)
            while due and due[0][0] <= t:
                r = heappop(due)[1]
                if free_at[r] <= t and wake[r] <= t and not in_sweep[r]:
                    in_sweep[r] = True
                    sweep.append(r)
            sweep.sort()
            last = -1
            continue
        r = heappop(sweep)
        in_sweep[r] = False
        before, last = last, r
        # the pick ([Note: greedy zero-bubble lists]): what r takes at t, if anything is ready
        soonest = inf
        kind = -1
        s = i = 0
        for k in order:
            if k == 0:  # I: the oldest microbatch, then the latest stage
                bi, bs = m, -1
                for u in mine[r]:
                    j = next_i[u]
                    if j < bi:
                        ready = done_f[u * m + j]
                        x = done_i[(u + 1) * m + j] + after_i[u]  # -inf past the last stage
                        if x > ready:
                            ready = x
                        if ready <= t:
                            bi, bs = j, u
                        elif ready < soonest:
                            soonest = ready
                if bs >= 0:
                    kind, s, i = 0, bs, bi
                    break
            elif k == 1:  # F, under the cap: the oldest microbatch, then the latest stage
                room = caps[r] - alive[r]
                if room > 0:
                    bi, bs = m, -1
                    for u in mine[r]:
                        j = next_f[u]
                        if j < bi and (room > later[u] or not reserve):
                            ready = done_f[(u - 1) * m + j] + after_f[u]  # 0 before the first stage
                            if ready <= t:
                                bi, bs = j, u
                            elif ready < soonest:
                                soonest = ready
                    if bs >= 0:
                        kind, s, i = 1, bs, bi
                        break
            elif pending_w[r]:  # W: the oldest
                kind = 2
                s, i = divmod(pending_w[r][0], m)
                break
        if watch and kind >= 0:  # does another preference decide otherwise ([Note: plays that fork])?
            for p in watch[:]:
                for k in orders[p]:
                    if k == kind:  # the same kind, so the same action
                        break
                    if order.index(k) > order.index(kind) and _has_ready(k, t, m, mine[r], last_stage, caps[r] - alive[r],
                                                                          next_i, next_f, done_i, done_f, after_i,
                                                                          after_f, pending_w[r]):
                        forked[p, False] = _state(t, sweep, r, before, in_sweep, mattered, start)
                        watch.remove(p)
                        if p in watch_reserve:  # its own play watches its reserve
                            watch_reserve.remove(p)
                        break
        if kind < 0:
            wake[r] = soonest
            if soonest < inf:
                heappush(due, (free_at[r] if free_at[r] > soonest else soonest, r))
            continue
        at = s * m + i
        if kind == 1:
            if caps[r] - alive[r] <= later[s]:  # with reserve, this forward would not have been taken
                mattered = True
                if watch_reserve:
                    for p in watch_reserve:
                        forked[p, True] = _state(t, sweep, r, before, in_sweep, mattered, start)
                    watch_reserve.clear()
            end = t + dur_f[s]
            done_f[at] = end
            next_f[s] += 1
            alive[r] += 1
            keys.append(F + at)
            q = where[s + 1] if s < last_stage else r
            if track:
                u_end = unit_clock[r]
                if s and unit_f[at - m] > u_end:
                    u_end = unit_f[at - m]
                u_end += 1
                unit_f[at] = u_end
        elif kind == 0:
            end = t + dur_i[s]
            done_i[at] = end
            next_i[s] += 1
            pending_w[r].append(at)
            keys.append(I + at)
            q = where[s - 1] if s else r
            if track:
                u_end = unit_clock[r]
                if unit_f[at] > u_end:
                    u_end = unit_f[at]
                if s < last_stage and unit_i[at + m] > u_end:
                    u_end = unit_i[at + m]
                u_end += 1
                unit_i[at] = u_end
        else:
            end = t + dur_w[s]
            pending_w[r].popleft()
            alive[r] -= 1
            keys.append(W + at)
            q = r
            if track:
                u_end = unit_clock[r]
                if unit_i[at] > u_end:
                    u_end = unit_i[at]
                u_end += 1
        if track:
            unit_clock[r] = u_end
            left[r] -= 1
            if u_end + left[r] > bound:  # at least that long at unit times: over the limit
                return None, mattered, inf, forked
        free_at[r], wake[r] = end, -inf
        heappush(due, (end, r))
        if q != r:  # the one rank that may wait for this result
            ready = end + comm_time
            if ready < wake[q]:
                wake[q] = ready
                heappush(due, (free_at[q] if free_at[q] > ready else ready, q))
                if ready <= t and free_at[q] <= t and q > last and not in_sweep[q]:
                    in_sweep[q] = True
                    heappush(sweep, q)  # still in this pass of the ranks
    return keys, mattered, float(max(unit_clock)) if track else inf, forked


def _state(t: float, sweep: list[int], r: int, before: int, in_sweep: list[bool], mattered: bool,
           start: State) -> State:
    """A copy of a play's state ``start`` (its lists as they are now) before rank ``r``, just taken
    from the ``sweep`` at ``t``, picks; ``before``: the rank checked before it."""
    again = sweep[:]
    heapq.heappush(again, r)
    flags = in_sweep[:]
    flags[r] = True
    copied = [x[:] if isinstance(x, list) else x for x in start[3:]]
    copied[4] = [deque(d) for d in copied[4]]  # pending_w
    copied[8] = flags
    copied[15] = mattered
    return [t, again, before, *copied]


def _has_ready(kind: int, t: float, m: int, mine: list[int], last_stage: int, room: int, next_i: list[int],
               next_f: list[int], done_i: list[float], done_f: list[float], after_i: list[float],
               after_f: list[float], pending: deque[int]) -> bool:
    """Whether a rank holding stages ``mine`` has an action of ``kind`` (0 I, 1 F without reserve,
    2 W) ready at ``t`` ([Note: greedy zero-bubble lists])."""
    if kind == 2:
        return bool(pending)
    for u in mine:
        if kind == 0:
            j = next_i[u]
            if j < m and done_f[u * m + j] <= t and (u == last_stage or done_i[(u + 1) * m + j] + after_i[u] <= t):
                return True
        elif room > 0:
            j = next_f[u]
            if j < m and (not u or done_f[(u - 1) * m + j] + after_f[u] <= t):
                return True
    return False
