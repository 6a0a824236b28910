"""Pipeline schedules as per-rank action lists, and a simulator that checks and times them (pure).

[Note: schedules]
A pipeline of ``S = pp * v`` stages runs ``m`` microbatches; stage ``s`` lives on rank ``s % pp``
(``v`` virtual stages per rank, "interleaved" when ``v > 1``); actions and dependencies are those
of [Note: action kinds] in ``_actions.py``. Each rank runs its list in order; sends never block,
a receive waits for the producing action. `simulate` replays that rule with unit times, proving
a schedule deadlock-free and giving its bubble (with ``F = 1``, ``B = 2``, GPipe and 1F1B take
``3 (m + p - 1)``, bubble ``(p - 1) / (m + p - 1)``; interleaving divides it by about ``v``).
Pairs (``FB``) whose halves run in input-arrival order are replayed in time order. With
``comm_time`` a message arrives that long after its action ends.

A schedule is a `ScheduleSpec` in the registry (``_registry.py``); the built-in ones are one file
each (``_schedule_*.py``), imported by this room's ``__init__`` in the order of ``SCHEDULES`` so
they register, above this file. ``zbv`` and ``dualpipev`` place stages in a V ([Note: stage
placement] in ``_placement.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, get_schedule, one_f_one_b_bubble

__all__ = ["build_schedule", "dependencies", "makespans", "played_makespans", "simulate", "theoretical_bubble"]


def build_schedule(schedule: str | ScheduleSpec, pp: int, microbatches: int,
                   virtual_stages: int = 1) -> list[list[Action]]:
    """The action list of every rank (index = rank on the ``pp`` axis) of the registered
    ``schedule``. See [Note: schedules]."""
    return get_schedule(schedule).actions(pp, microbatches, virtual_stages)


def dependencies(a: Action, num_stages: int, split: set[tuple[int, int]]) -> list[Action]:
    """The actions ``a`` waits for ([Note: action kinds]); ``split``: the ``(stage, microbatch)``
    pairs whose backward is split into I and W. A pair (``FB``) waits for what its halves wait for."""
    return [Action(*k) for h in a.halves for k in _dep_keys(h, num_stages, split)]


def _dep_keys(a: Action, num_stages: int, split: set[tuple[int, int]]) -> list[tuple[ActionKind, int, int]]:
    """What the half ``a`` waits for, as ``(kind, stage, microbatch)`` keys ([Note: action kinds])."""
    s, i = a.stage, a.microbatch
    if a.kind is ActionKind.F:
        return [(ActionKind.F, s - 1, i)] if s > 0 else []
    if a.kind is ActionKind.W:
        return [(ActionKind.I, s, i)]
    deps = [(ActionKind.F, s, i)]
    if s < num_stages - 1:
        deps.append((ActionKind.I if (s + 1, i) in split else ActionKind.B, s + 1, i))
    return deps


def _check_complete(got: list[Action], num_stages: int, microbatches: int) -> set[tuple[int, int]]:
    """The split pairs; ``ValueError`` unless every (stage, microbatch) has one F and either one B
    or one I and one W. ``got``: the actions, pairs already cut into their halves."""
    n, m = num_stages * microbatches, microbatches
    seen = bytearray(4 * n)  # F, B, I, W of pair s * m + i: at j * n + s * m + i
    base = {ActionKind.F: 0, ActionKind.B: n, ActionKind.I: 2 * n, ActionKind.W: 3 * n}
    split: set[tuple[int, int]] = set()
    fine = True
    for a in got:
        s, i, at = a.stage, a.microbatch, base.get(a.kind)
        if at is None or not (0 <= s < num_stages and 0 <= i < m) or seen[at + s * m + i]:
            fine = False  # an FB half, out of range, or twice
            break
        seen[at + s * m + i] = 1
        if a.kind is ActionKind.I:
            split.add((s, i))
    if fine:  # every F; I and W together; B exactly where there is no I
        f, b, i_, w = (bytes(seen[j * n:(j + 1) * n]) for j in range(4))
        fine = f == b"\x01" * n and i_ == w and b == i_.translate(_FLIP)
    if not fine:
        raise ValueError("schedule does not run every F and B (or I and W) of every stage and microbatch exactly "
                         "once")
    return split


_FLIP = bytes.maketrans(b"\x00\x01", b"\x01\x00")


def simulate(actions: Sequence[Sequence[Action]], num_stages: int, microbatches: int, *, f_time: float = 1.0,
             b_time: float = 2.0, w_time: float | None = None,
             costs: Mapping[tuple[str, int], float] | None = None, comm_time: float = 0.0,
             overlap: float | None = None) -> tuple[float, list[float]]:
    """Run the per-rank lists with the dependency rule of [Note: schedules]; return the makespan
    and each rank's busy time. A split backward takes ``b_time - w_time`` for I and ``w_time``
    for W (default: half each). ``costs[(kind, stage)]`` (kind ``"F"``, ``"B"``, ``"I"`` or
    ``"W"``), where given, is the duration of that kind of action on that stage instead (e.g.
    measured ones: `PipelineSchedule.last_action_times`). ``comm_time``: a message between two
    ranks arrives that long after the action that makes it ends (a hand-off between two stages
    of one rank takes no time). Raises ``ValueError`` on a deadlock, a missing or repeated action.

    Pairs (``FB``, [Note: action kinds]): by default as `PipelineSchedule` runs them without an
    overlap function, the halves one after the other, the one whose inputs are there first going
    first (a tie: the forward), each half's output leaving when that half ends; a pair costs its
    halves' costs. ``overlap`` (in ``[0, 1]``) models an overlap function instead: the pair starts
    once both halves' inputs are there, lasts ``f + b - overlap * min(f, b)`` (1: the shorter
    half hidden behind the longer), and both outputs leave at its end. Either way, a pair whose
    halves wait on each other is refused ([Note: forward/backward pairs] in
    ``_pipeline/_runtime/_pipeline_schedule.py``)."""
    if overlap is not None and not 0.0 <= overlap <= 1.0:
        raise ValueError(f"simulate: overlap={overlap!r}; it is the fraction of a pair's shorter half hidden, in "
                         "[0, 1] (None: the halves one after the other)")
    if not comm_time >= 0:
        raise ValueError(f"simulate: comm_time={comm_time!r}; it is a duration, >= 0")
    w = b_time / 2 if w_time is None else w_time
    unit = {ActionKind.F: f_time, ActionKind.B: b_time, ActionKind.I: b_time - w, ActionKind.W: w}
    given = costs or {}
    cost = {(k, s): given.get((k.value, s), t) for k, t in unit.items() for s in range(num_stages)}
    got = [h for acts in actions for a in acts for h in a.halves]
    split = _check_complete(got, num_stages, microbatches)
    if overlap is not None or not any(a.kind is ActionKind.FB for acts in actions for a in acts):
        return _sweep(actions, num_stages, split, cost, comm_time, overlap or 0.0)
    _sweep(actions, num_stages, split, cost, comm_time, 1.0)  # refuses pairs that wait on each other
    return _replay(actions, num_stages, split, cost, comm_time)


def _sweep(actions: Sequence[Sequence[Action]], num_stages: int, split: set[tuple[int, int]],
           cost: Mapping[tuple[ActionKind, int], float], comm_time: float,
           overlap: float) -> tuple[float, list[float]]:
    """`simulate` of lists whose order is fixed (no pair, or each pair's halves run together)."""
    return _timed(_order(actions, num_stages, split), len(actions), num_stages, cost, comm_time, overlap)


_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)  # the kinds of halves, by code
_Step = tuple[int, Sequence[int], Sequence[int], Sequence[int]]
"""An action in `_order`: its rank, the keys of its halves, the keys of what they wait for, and
``code * num_stages + stage`` of each half (where its duration is looked up)."""


def _order(actions: Sequence[Sequence[Action]], num_stages: int,
           split: set[tuple[int, int]]) -> tuple[list[_Step], int]:
    """Every action once, each after the actions it waits for and the earlier ones of its rank,
    and the number of keys: each rank runs its list as far as the inputs are there, then waits
    for the first missing one and goes on when that is done (each action is looked at about
    once). Start times follow from any such order ([Note: schedules]); raises ``ValueError``
    if the lists deadlock. An action's key is ``(code * num_stages + stage) * m + microbatch``."""
    n, S = len(actions), num_stages
    m = 1 + max((h.microbatch for acts in actions for a in acts for h in a.halves), default=0)
    F, B, I, W = (c * S * m for c in range(4))
    code = {k: c for c, k in enumerate(_KINDS)}

    def deps(h: Action) -> list[int]:  # _dep_keys as keys
        s, i = h.stage, h.microbatch
        if h.kind is ActionKind.F:
            return [F + (s - 1) * m + i] if s else []
        if h.kind is ActionKind.W:
            return [I + s * m + i]
        if s + 1 < S:
            return [F + s * m + i, (I if (s + 1, i) in split else B) + (s + 1) * m + i]
        return [F + s * m + i]

    def step(r: int, a: Action) -> _Step:
        if a.kind is ActionKind.FB:
            cs = [code[h.kind] * S + h.stage for h in a.sub]
            return r, [c * m + h.microbatch for c, h in zip(cs, a.sub)], deps(a.sub[0]) + deps(a.sub[1]), cs
        c = code[a.kind] * S + a.stage
        return r, [c * m + a.microbatch], deps(a), [c]

    rows = [[step(r, a) for a in acts] for r, acts in enumerate(actions)]
    done = [False] * (4 * S * m)
    waiting: dict[int, list[int]] = {}
    pos = [0] * n
    order: list[_Step] = []
    todo = list(range(n - 1, -1, -1))  # the ranks to advance (a stack)
    while todo:
        r = todo.pop()
        row = rows[r]
        while pos[r] < len(row):
            st = row[pos[r]]
            missing = [d for d in st[2] if not done[d]]
            if missing:
                waiting.setdefault(missing[0], []).append(r)
                break
            order.append(st)
            for k in st[1]:
                done[k] = True
                if k in waiting:
                    todo.extend(waiting.pop(k))
            pos[r] += 1
    stuck = {r: acts[pos[r]] for r, acts in enumerate(actions) if pos[r] < len(acts)}
    if stuck:
        together = " when each pair's halves run together (a pair's halves must not wait on each other)" if any(
            a.kind is ActionKind.FB for a in stuck.values()) else ""
        raise ValueError(f"schedule deadlocks{together}: ranks wait on {stuck}")
    return order, len(done)


def _timed(ordered: tuple[list[_Step], int], n: int, num_stages: int,
           cost: Mapping[tuple[ActionKind, int], float], comm_time: float,
           overlap: float) -> tuple[float, list[float]]:
    """Makespan and busy time per rank of the actions ordered by `_order`, each starting when
    its rank is free and its inputs are there; a pair lasts ``f + b - overlap * min(f, b)``."""
    order, n_keys = ordered
    took_of = [cost[k, s] for k in _KINDS for s in range(num_stages)]
    end, rank_of = [0.0] * n_keys, [0] * n_keys
    clock, busy = [0.0] * n, [0.0] * n
    for r, halves, deps, cs in order:
        if len(cs) == 2:
            f, b = took_of[cs[0]], took_of[cs[1]]
            took = f + b - overlap * min(f, b)
        else:
            took = took_of[cs[0]]
        start = clock[r]
        for d in deps:
            t = end[d] + comm_time if rank_of[d] != r else end[d]
            if t > start:
                start = t
        for k in halves:
            end[k], rank_of[k] = start + took, r
        clock[r] = start + took
        busy[r] += took
    return max(clock), busy


def makespans(actions: Sequence[Sequence[Action]], num_stages: int, microbatches: int,
              costs: Sequence[Mapping[tuple[str, int], float] | None], *, comm_time: float = 0.0,
              first_at_most: float | None = None) -> list[float]:
    """``[simulate(actions, num_stages, microbatches, costs=c, comm_time=comm_time)[0] for c in costs]``,
    checking and ordering the lists once (the makespan of one list under several cost models);
    with ``first_at_most``, only the first makespan if it is above that."""
    if any(a.kind is ActionKind.FB for acts in actions for a in acts):
        out = []
        for c in costs:
            out.append(simulate(actions, num_stages, microbatches, costs=c, comm_time=comm_time)[0])
            if first_at_most is not None and out[0] > first_at_most:
                break
        return out
    split = _check_complete([a for acts in actions for a in acts], num_stages, microbatches)
    steps, n_keys = _order(actions, num_stages, split)
    return _spans_of(steps, n_keys, len(actions), num_stages, costs, comm_time, first_at_most)


def played_makespans(keys: Sequence[int], ranks: Sequence[int], num_stages: int, microbatches: int,
                     costs: Sequence[Mapping[tuple[str, int], float] | None]) -> list[float]:
    """``makespans`` of lists of split backwards (no pair, no ``B``) given as the keys of their
    actions (``(code * num_stages + stage) * microbatches + microbatch``, code 0, 2, 3 for F, I, W)
    in an order in which each comes after the actions it waits for and the earlier ones of its
    rank (a play's: `_play` in ``_schedule_greedy.py``); ``ranks[s]``: the rank of stage ``s``.
    The same figures as `makespans` of the lists, without checking or ordering them again."""
    S, m = num_stages, microbatches
    n = S * m
    steps: list[_Step] = []
    for key in keys:
        c, at = divmod(key, n)
        s = at // m
        if c == 0:  # tuples of ints: the collector stops tracking them at once (no list per action)
            deps: tuple[int, ...] = (key - m,) if s else ()
        elif c == 3:
            deps = (key - n,)
        else:
            deps = (at, key + m) if s + 1 < S else (at,)
        steps.append((ranks[s], (key,), deps, (c * S + s,)))
    return _spans_of(steps, 4 * n, 1 + max(ranks, default=0), S, costs, 0.0, None)


def _spans_of(steps: list[_Step], n_keys: int, n: int, num_stages: int,
              costs: Sequence[Mapping[tuple[str, int], float] | None], comm_time: float,
              first_at_most: float | None) -> list[float]:
    """The makespans of ordered steps (`_order`) under each of ``costs`` (`makespans`)."""
    unit = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}
    out = []
    for given in costs:
        cost = {(k, s): (given or {}).get((k.value, s), t) for k, t in unit.items() for s in range(num_stages)}
        out.append(_timed((steps, n_keys), n, num_stages, cost, comm_time, 0.0)[0])
        if first_at_most is not None and out[0] > first_at_most:
            break
    return out


def _replay(actions: Sequence[Sequence[Action]], num_stages: int, split: set[tuple[int, int]],
            cost: Mapping[tuple[ActionKind, int], float], comm_time: float) -> tuple[float, list[float]]:
    """`simulate` of lists with pairs whose halves run in arrival order: commit, of every rank's
    next half whose inputs are known, the one that starts first (a tie: the lower rank).
    Whatever is not committed yet waits for something that ends no earlier, so a pair's half
    that waits cannot have been ready before the half committed first. A rank's next step,
    once known, changes only when that rank commits, or, in a pair, when its other half gets ready."""
    rank_of = {h: r for r, acts in enumerate(actions) for a in acts for h in a.halves}
    deps_of = {h: dependencies(h, num_stages, split) for h in rank_of}
    done: dict[Action, float] = {}
    n = len(actions)
    pos, clock, busy = [0] * n, [0.0] * n, [0.0] * n

    def candidate(r: int) -> tuple[float, Action] | None:
        """(start, half) of rank ``r``'s next half to run, if its inputs are known."""
        if pos[r] == len(actions[r]):
            return None
        best: tuple[float, Action] | None = None
        for h in actions[r][pos[r]].halves:
            if h in done or any(d not in done for d in deps_of[h]):
                continue
            t = max([0.0, *(done[d] + (comm_time if rank_of[d] != r else 0.0) for d in deps_of[h])])
            if best is None or t < best[0]:
                best = (t, h)
        return None if best is None else (max(clock[r], best[0]), best[1])

    cands = [candidate(r) for r in range(n)]
    remaining = len(rank_of)
    while remaining:
        live = [(c[0], r) for r, c in enumerate(cands) if c is not None]
        if not live:
            stuck = {r: actions[r][pos[r]] for r in range(n) if pos[r] < len(actions[r])}
            raise ValueError(f"schedule deadlocks: ranks wait on {stuck}")
        start, r = min(live)
        c = cands[r]
        assert c is not None
        h = c[1]
        done[h] = clock[r] = start + cost[h.kind, h.stage]
        busy[r] += cost[h.kind, h.stage]
        remaining -= 1
        if all(x in done for x in actions[r][pos[r]].halves):
            pos[r] += 1
        for q in range(n):
            if q == r or cands[q] is None or (pos[q] < len(actions[q]) and actions[q][pos[q]].kind is ActionKind.FB):
                cands[q] = candidate(q)
    return max(clock), busy


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1, *,
                       schedule: str | ScheduleSpec | None = None) -> float:
    """The idle fraction of a rank (forward time 1, backward 2): the registered ``schedule``'s
    ``bubble``, or without one GPipe's / 1F1B's ``(p - 1) / (v m + p - 1)``."""
    if schedule is None:
        return one_f_one_b_bubble(pp, microbatches, virtual_stages)
    spec = get_schedule(schedule)
    if spec.bubble is None:
        raise ValueError(f"pipeline: schedule {spec.name!r} states no theoretical bubble; use simulate()")
    return spec.bubble(pp, microbatches, virtual_stages)
