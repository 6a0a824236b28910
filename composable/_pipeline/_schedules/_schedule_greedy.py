"""Zero-bubble action lists built by a list scheduler, over unit or measured times (pure).

[Note: greedy zero-bubble lists]
`greedy_lists` plays all ranks forward in time. A free rank takes, by default in this order
(``prefer="IFW"``): a ready ``I`` (the critical path; oldest microbatch, then latest stage); a
ready ``F`` while its live microbatch-stages (``F`` done, ``W`` not yet) are under its ``cap``
(latest stage, then oldest microbatch); a pending ``W`` (oldest first); else it waits. What each
rank ran is its action list; every action started after its dependencies ended, so the lists are
deadlock-free under any timing (``simulate`` checks it too). The ``cap`` bounds peak activations:
ZBV's is ``2 p``, interleaved ZB's that of interleaved 1F1B; weight gradients fill 1F1B's idle time.

With ``costs`` (seconds per ``(kind, stage)``, as `simulate` takes them) actions take those
durations and messages arrive ``comm_time`` after their sender ([Note: schedules tuned to
measured costs] in ``_schedule_tuned.py``); without, every action takes one unit, messages none.

[Note: the play's events]
The play is defined instant by instant: at each instant something ends, every free rank picks,
in rank order. A rank's choices change only when it acts or when a result it waits for arrives
(the ``F`` of the stage before, the ``I`` of the stage after), so a rank that finds nothing
records the earliest arrival already under way (``wake``), a rank starting such a result lowers
the waiter's ``wake``, and a rank is examined only at or after both ``free_at`` and ``wake`` (a
heap). Only examinations that would find nothing are skipped, in the same rank order, so the
lists equal the instant-by-instant play's at ``O(actions log p)`` instead of ``O(p x instants)``
(29-53 s for ``interleaved_zb`` at p=32, m=32, v=4). Actions are recorded as `simulate`'s integer
keys in the order run: `played_makespans` times them as they are, `played_lists` makes ``Action`` s.

[Note: plays that fork]
Plays differing only in ``prefer`` or ``reserve`` agree up to the first pick where one would take
another action. A play watching other preferences (``forks``) checks at each pick whether one
would take a kind it prefers that has an action ready; ``reserve`` changes a decision exactly
when the play takes a forward reserve would refuse (``room <= later[s]``), so ``reserve_forks``
fork there while their preference has not forked. At such a pick the state is copied (`_state`)
and the other play goes on from it (``start``), making the lists it would make from the start.
``wake`` instants copied from a play without reserve are no later than its own, so nothing is
missed. A play cut short by its limit cuts short the plays not yet forked.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
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


@dataclass(slots=True)
class _Board:
    """What a play knows before it starts: the stages' ranks and durations ([Note: greedy
    zero-bubble lists])."""

    pp: int
    m: int
    S: int
    where: list[int]
    mine: list[list[int]]  # per rank, its stages, latest first
    later: list[int]  # per stage, the rank's stages after it
    caps: list[int]
    dur_f: list[float]  # per stage, how long an F / I / W takes
    dur_i: list[float]
    dur_w: list[float]
    after_f: list[float]  # F(s-1) -> F(s)
    after_i: list[float]  # I(s+1) -> I(s)
    comm_time: float
    I: int = 0  # the offsets of the I / W keys (F's is 0)
    W: int = 0

    @classmethod
    def make(cls, pp: int, m: int, v: int, placement: str, cap: Callable[[int], int],
             costs: Mapping[tuple[str, int], float] | None, comm_time: float) -> _Board:
        S = pp * v
        where = [stage_rank(s, pp, placement) for s in range(S)]
        mine = [sorted((s for s in range(S) if where[s] == r), reverse=True) for r in range(pp)]
        dur = {k: [1.0 if costs is None else float(costs.get((k, s), 1.0)) for s in range(S)] for k in "FIW"}
        return cls(pp, m, S, where, mine, [sum(1 for u in mine[where[s]] if u > s) for s in range(S)],
                   [cap(r) for r in range(pp)], dur["F"], dur["I"], dur["W"],
                   [comm_time if s and where[s - 1] != where[s] else 0.0 for s in range(S)],
                   [comm_time if s + 1 < S and where[s + 1] != where[s] else 0.0 for s in range(S)], comm_time,
                   2 * S * m, 3 * S * m)


@dataclass(slots=True)
class _PlayState:
    """A play's state between two picks; one that forks is copied (`fork`) and another play that
    made the same decisions so far goes on from the copy ([Note: plays that fork]). Finish times
    are kept at ``s * m + i``: ``inf`` not started; ``F`` of "stage -1" (index ``-m + i``) at 0,
    ``I`` of "stage S" at ``-inf``: what the first / last stage waits for."""

    t: float  # the instant
    sweep: list[int]  # the ranks still to check at it (a heap)
    last: int  # the rank checked last
    done_f: list[float]  # when F(s, i) ends
    done_i: list[float]  # when I(s, i) ends
    next_f: list[int]  # per stage, the next microbatch to forward
    next_i: list[int]  # ... and to I
    pending_w: list[deque[int]]  # per rank, s * m + i of the I's whose W is due
    alive: list[int]  # per rank, microbatch-stages held alive
    free_at: list[float]
    wake: list[float]
    in_sweep: list[bool]
    keys: list[int]  # the keys so far
    due: list[tuple[float, int]]  # (when rank r is checked next, r): a heap
    unit_f: list[int]  # at unit times: when F(s, i) ends
    unit_i: list[int]  # ... I(s, i)
    unit_clock: list[int]  # ... each rank's clock
    left: list[int]  # the actions each rank has still to run
    mattered: bool  # reserve changed a decision

    @classmethod
    def first(cls, b: _Board) -> _PlayState:
        inf, n, pp = float("inf"), b.S * b.m, b.pp
        return cls(0.0, [], -1, [inf] * n + [0.0] * b.m, [inf] * n + [-inf] * b.m, [0] * b.S, [0] * b.S,
                   [deque() for _ in range(pp)], [0] * pp, [0.0] * pp, [-inf] * pp, [False] * pp, [],
                   [(0.0, r) for r in range(pp)], [0] * n, [0] * n, [0] * pp,
                   [3 * len(b.mine[r]) * b.m for r in range(pp)], False)

    def fork(self, t: float, r: int, before: int, mattered: bool) -> _PlayState:
        """A copy as it is now, before rank ``r`` (just taken from the sweep at ``t``) picks;
        ``before``: the rank checked before it."""
        copied: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        copied.update({k: v[:] for k, v in copied.items() if isinstance(v, list)}, t=t, last=before, mattered=mattered,
                      pending_w=[deque(d) for d in self.pending_w])
        copied["in_sweep"][r] = True
        heapq.heappush(copied["sweep"], r)
        return _PlayState(**copied)


def _pick(b: _Board, st: _PlayState, r: int, t: float, order: list[int], reserve: bool) -> tuple[int, int, int, float]:
    """What rank ``r`` takes at ``t`` ([Note: greedy zero-bubble lists]): ``(kind, stage,
    microbatch, soonest)``, kind 0 I, 1 F, 2 W, -1 nothing (then ``soonest``: the earliest arrival
    among the results it waits for that are under way)."""
    m, soonest, mine, done_f = b.m, float("inf"), b.mine[r], st.done_f
    for k in order:
        if k == 0:  # I: the oldest microbatch, then the latest stage
            bi, bs, next_i, done_i, after_i = m, -1, st.next_i, st.done_i, b.after_i
            for u in mine:
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
                return 0, bs, bi, soonest
        elif k == 1:  # F, under the cap: the oldest microbatch, then the latest stage
            room = b.caps[r] - st.alive[r]
            if room > 0:
                bi, bs, next_f, after_f, later = m, -1, st.next_f, b.after_f, b.later
                for u in mine:
                    j = next_f[u]
                    if j < bi and (room > later[u] or not reserve):
                        ready = done_f[(u - 1) * m + j] + after_f[u]  # 0 before the first stage
                        if ready <= t:
                            bi, bs = j, u
                        elif ready < soonest:
                            soonest = ready
                if bs >= 0:
                    return 1, bs, bi, soonest
        elif st.pending_w[r]:  # W: the oldest
            s, i = divmod(st.pending_w[r][0], m)
            return 2, s, i, soonest
    return -1, 0, 0, soonest


def _run(b: _Board, st: _PlayState, r: int, t: float, kind: int, s: int, i: int, track: bool) -> tuple[float, int]:
    """Rank ``r`` runs the action it picked at ``t``: ``(when it ends, the one rank that may wait
    for its result)``; at unit times (``track``) the rank's clock moves on too."""
    m = b.m
    at = s * m + i
    if kind == 1:
        end = st.done_f[at] = t + b.dur_f[s]
        st.next_f[s] += 1
        st.alive[r] += 1
        st.keys.append(at)
        q = b.where[s + 1] if s < b.S - 1 else r
        if track:
            clock = st.unit_clock[r]
            if s and st.unit_f[at - m] > clock:
                clock = st.unit_f[at - m]
            st.unit_f[at] = clock + 1
    elif kind == 0:
        end = st.done_i[at] = t + b.dur_i[s]
        st.next_i[s] += 1
        st.pending_w[r].append(at)
        st.keys.append(b.I + at)
        q = b.where[s - 1] if s else r
        if track:
            clock = st.unit_clock[r]
            if st.unit_f[at] > clock:
                clock = st.unit_f[at]
            if s < b.S - 1 and st.unit_i[at + m] > clock:
                clock = st.unit_i[at + m]
            st.unit_i[at] = clock + 1
    else:
        end = t + b.dur_w[s]
        st.pending_w[r].popleft()
        st.alive[r] -= 1
        st.keys.append(b.W + at)
        q = r
        if track:
            clock = st.unit_clock[r]
            if st.unit_i[at] > clock:
                clock = st.unit_i[at]
    if track:
        st.unit_clock[r] = clock + 1
        st.left[r] -= 1
    return end, q


def _play(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int],
          costs: Mapping[tuple[str, int], float] | None, comm_time: float, prefer: str,
          reserve: bool, limit: float | None = None, *, forks: Sequence[str] = (),
          reserve_forks: Sequence[str] = (), start: _PlayState | None = None
          ) -> tuple[list[int] | None, bool, float, dict[Fork, _PlayState]]:
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
    b = _Board.make(pp, m, v, placement, cap, costs, comm_time)
    st = _PlayState.first(b) if start is None else start
    inf = float("inf")
    codes = {"I": 0, "F": 1, "W": 2}
    order = [codes[k] for k in prefer]
    t, sweep, last, mattered = st.t, st.sweep, st.last, st.mattered
    track = limit is not None
    bound = inf if limit is None else limit
    watch = [p for p in forks if p != prefer]
    orders = {p: [codes[k] for k in p] for p in watch}
    assert not (watch and reserve), "a play with reserve forks no other preference"
    watch_reserve = list(reserve_forks)
    forked: dict[Fork, _PlayState] = {}
    total = 3 * b.S * m
    due, in_sweep, free_at, wake, keys = st.due, st.in_sweep, st.free_at, st.wake, st.keys
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
        kind, s, i, soonest = _pick(b, st, r, t, order, reserve)
        if watch and kind >= 0:  # does another preference decide otherwise ([Note: plays that fork])?
            for p in watch[:]:
                for k in orders[p]:
                    if k == kind:  # the same kind, so the same action
                        break
                    if order.index(k) > order.index(kind) and _has_ready(b, st, k, t, r):
                        forked[p, False] = st.fork(t, r, before, mattered)
                        watch.remove(p)
                        if p in watch_reserve:  # its own play watches its reserve
                            watch_reserve.remove(p)
                        break
        if kind < 0:
            wake[r] = soonest
            if soonest < inf:
                heappush(due, (free_at[r] if free_at[r] > soonest else soonest, r))
            continue
        if kind == 1 and b.caps[r] - st.alive[r] <= b.later[s]:  # with reserve, this forward would not be taken
            mattered = True
            for p in watch_reserve:
                forked[p, True] = st.fork(t, r, before, mattered)
            watch_reserve.clear()
        end, q = _run(b, st, r, t, kind, s, i, track)
        if track and st.unit_clock[r] + st.left[r] > bound:  # at least that long at unit times: over the limit
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
    return keys, mattered, float(max(st.unit_clock)) if track else inf, forked


def _has_ready(b: _Board, st: _PlayState, kind: int, t: float, r: int) -> bool:
    """Whether rank ``r`` has an action of ``kind`` (0 I, 1 F without reserve, 2 W) ready at
    ``t`` ([Note: greedy zero-bubble lists])."""
    if kind == 2:
        return bool(st.pending_w[r])
    m, room = b.m, b.caps[r] - st.alive[r]
    for u in b.mine[r]:
        if kind == 0:
            j = st.next_i[u]
            if j < m and st.done_f[u * m + j] <= t and (u == b.S - 1 or st.done_i[(u + 1) * m + j] + b.after_i[u] <= t):
                return True
        elif room > 0:
            j = st.next_f[u]
            if j < m and (not u or st.done_f[(u - 1) * m + j] + b.after_f[u] <= t):
                return True
    return False
