"""``zbv`` and ``interleaved_zb``: zero-bubble lists over several stages per rank.

``zbv`` (the ZB-V schedule): two stages per rank in a V ([Note: stage placement]: rank ``r``
holds stages ``r`` and ``2 p - 1 - r``), every backward split into ``I`` and ``W``, at most
``2 p`` microbatch-stages alive per rank (1F1B's ``p`` microbatches of the rank's layers).
``interleaved_zb``: ``v`` stages per rank in the loop placement, split backwards, each rank's
peak activations capped at interleaved 1F1B's (``min(2 (p - r - 1) + (v - 1) p + 1, v m)``
microbatch-stages). Both lists come from the list scheduler of [Note: greedy zero-bubble
lists] in ``_schedule_greedy.py``, played on a model of real stages ([Note: lists played on a
model of real stages]); `simulate` gives their bubble (no closed form is claimed).

[Note: lists played on a model of real stages]
Played with one unit per action, the list scheduler makes lists that are optimal for stages that
do not exist: on every real pipeline the first stage's ``I`` has nothing to compute (no input
gradient) and its ``W`` is its whole backward, and the last stage carries the head and the loss.
Under the times measured on the example Llama (dim 512, p=2, m=4) our unit-time ``zbv`` list
simulated 5% longer than torch's ``ScheduleZBVZeroBubble`` order. So the registered list is the
best of these candidates: the unit-time play, and the plays under each order of preference
(`PREFERENCES`), with and without a reserved slot, on each cost model of `STAGE_MODELS` (the first
stage's ``I`` = 0 and ``W`` = ``I + W``; ``I : W`` = 1 : 1, 1.15 : 0.85 or 0.85 : 1.15; the last
stage's actions 1 or 1.2 times the others). Best: the least sum of `simulate`'s makespans over
the models, among the candidates no longer than the unit-time play at unit times (so every
bound proved at unit times still holds); ties go to the unit-time play. On those measured times
the result is 0.1% from torch's order for ``zbv`` and 0.4% for ``interleaved_zb`` (the unit-time
lists: 5.1% and 2.7%); over the models, 0-8% shorter than the unit-time lists at p = 1-8.
Deterministic, and each ``(p, m, v)`` is built once per process ([Note: building the registered
lists]). `tune_schedule` refits a list to a run's own measured times.

[Note: building the registered lists]
Up to 19 plays (the unit-time one; 3 models x 3 preferences x with/without reserve), each linear
in the number of actions ``3 p v m`` ([Note: the play's events] in ``_schedule_greedy.py``), and
the makespans of the candidates. Most candidates lose on the first test: longer than the
unit-time play at unit times. So every play on a model times its own list at unit times as it
goes (its order is one `simulate` may run, and at unit times an action ends one unit after the
later of its rank's clock and what it waits for) and stops once rank ``r``'s clock plus the
actions it still has to run exceeds the unit-time play's makespan: no order of the rest can make
that list short enough (each action takes a unit on its rank). The plays of one model under the
other preferences and with reserve go on from where they first decide otherwise ([Note: plays
that fork] in ``_schedule_greedy.py``), so their common beginning is played once; a play is kept
as integer keys and only the chosen list becomes ``Action`` s; the unit-time play's makespans on
the models are computed only when another candidate is left to compare with. The lists are exactly those of the plain algorithm
(``tests/test_pipeline_schedule_build.py``). Measured against torch's own build of
``ScheduleInterleavedZeroBubble`` (its constructor orders every rank's actions and adds the sends
and receives) in one process on a shared 2-core machine (``benchmarks/pipeline_zb.py --parts
build``, docs/benchmarks.md): ``interleaved_zb`` at p=32, m=32, v=4 0.25 s of CPU (torch 0.55 s;
before the event-driven play 29-53 s), at p=64, m=128, v=2 2.4 s (torch 3.3 s) and v=4 8.6 s
(torch 4.4 s: there most plays run to 50-99% before the bound stops them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache

from ._actions import Action
from ._registry import ScheduleSpec, register_schedule
from ._placement import stage_rank
from ._schedule_greedy import PREFERENCES, _play, played_lists
from ._simulate import played_makespans

__all__ = ["INTERLEAVED_ZB", "STAGE_MODELS", "ZBV", "izb_cap", "zbv_cap"]

STAGE_MODELS = ((1.0, 1.0, 1.0), (1.15, 0.85, 1.2), (0.85, 1.15, 1.2))
"""The cost models the registered lists are played on ([Note: lists played on a model of real
stages]): ``(I, W, last)``: every ``F`` takes 1, ``I`` and ``W`` these, the first stage's ``I`` 0
and its ``W`` ``I + W``, and every action of the last stage ``last`` times as long."""


def _model(S: int, i: float, w: float, last: float) -> dict[tuple[str, int], float]:
    costs = {(k, s): t for s in range(S) for k, t in (("F", 1.0), ("I", i), ("W", w))}
    costs[("I", 0)], costs[("W", 0)] = 0.0, i + w
    for k in "FIW":
        costs[(k, S - 1)] *= last
    return costs


def _played_on_models(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int]) -> list[list[Action]]:
    """The registered list: [Note: lists played on a model of real stages]. Cost: [Note: building
    the registered lists]."""
    S = pp * v
    models = [_model(S, *x) for x in STAGE_MODELS]
    ranks = [stage_rank(s, pp, placement) for s in range(S)]
    unit, _, span, _ = _play(pp, m, v, placement, cap, None, 0.0, "IFW", False, float("inf"))
    limit = span + 1e-9
    assert unit is not None
    best, best_sum = unit, None  # the unit play's sum only once another candidate is there to beat it
    for keys in _candidates(pp, m, v, placement, cap, models, limit):
        if best_sum is None:
            best_sum = sum(played_makespans(unit, ranks, S, m, models))
        total = sum(played_makespans(keys, ranks, S, m, models))
        if total < best_sum * (1 - 1e-9):
            best, best_sum = keys, total
    return played_lists(best, pp, m, v, placement)


def _candidates(pp: int, m: int, v: int, placement: str, cap: Callable[[int], int],
                models: list[dict[tuple[str, int], float]], limit: float) -> Iterator[list[int]]:
    """After the unit-time play: the plays on each model under each preference, without and with
    reserve, that are no longer than ``limit`` at unit times (a play cut short there, or one that
    stalls under the cap, is none; a play made twice is given once), as `_play` gives them. The
    plays of one model go on from where they first decide otherwise ([Note: plays that fork] in
    ``_schedule_greedy.py``)."""
    first, *others = PREFERENCES
    for costs in models:
        got: dict[tuple[str, bool], list[int] | None] = {}
        got[first, False], _, _, forks = _play(pp, m, v, placement, cap, costs, 0.0, first, False, limit,
                                               forks=others, reserve_forks=PREFERENCES)
        for prefer in others:
            if (prefer, False) in forks:
                got[prefer, False], _, _, more = _play(pp, m, v, placement, cap, costs, 0.0, prefer, False, limit,
                                                       reserve_forks=(prefer,), start=forks.pop((prefer, False)))
                forks.update(more)
        for (prefer, reserve), state in forks.items():
            got[prefer, reserve] = _play(pp, m, v, placement, cap, costs, 0.0, prefer, reserve, limit, start=state)[0]
        for prefer in PREFERENCES:
            for reserve in (False, True):
                keys = got.get((prefer, reserve))
                if keys is not None:
                    yield keys


def zbv_cap(pp: int, m: int, v: int) -> Callable[[int], int]:
    """ZBV's cap per rank, in microbatch-stages: ``2 p`` (1F1B's ``p`` microbatches of a rank)."""
    return lambda r: 2 * pp


def izb_cap(pp: int, m: int, v: int) -> Callable[[int], int]:
    """Interleaved ZB's cap per rank: interleaved 1F1B's peak, ``min(2 (p - r - 1) + (v - 1) p + 1, v m)``."""
    return lambda r: max(v, min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m))


@lru_cache(maxsize=64)
def _zbv_lists(pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, _played_on_models(pp, m, 2, "v", zbv_cap(pp, m, 2))))


@lru_cache(maxsize=64)
def _izb_lists(pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, _played_on_models(pp, m, v, "loop", izb_cap(pp, m, v))))


ZBV = register_schedule(ScheduleSpec(
    "zbv", lambda r, pp, m, v: list(_zbv_lists(pp, m)[r]), virtual=True, placement="v", exact_virtual_stages=2,
    summary="two stages per rank in a V, split backwards, 1F1B's peak activations (ZB-V)"))
INTERLEAVED_ZB = register_schedule(ScheduleSpec(
    "interleaved_zb", lambda r, pp, m, v: list(_izb_lists(pp, m, v)[r]), virtual=True,
    summary="v stages per rank, split backwards, interleaved 1F1B's peak activations"))
