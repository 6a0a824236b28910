"""``zbv`` and ``interleaved_zb``: zero-bubble lists over several stages per rank.

``zbv`` (ZB-V): two stages per rank in a V ([Note: stage placement]: rank ``r`` holds stages ``r``
and ``2 p - 1 - r``), backwards split into ``I`` and ``W``, at most ``2 p`` microbatch-stages alive
per rank. ``interleaved_zb``: ``v`` stages per rank in the loop placement, split backwards, peak
activations capped at interleaved 1F1B's (``min(2 (p - r - 1) + (v - 1) p + 1, v m)``). Both come
from the list scheduler of [Note: greedy zero-bubble lists] in ``_schedule_greedy.py``, played on
a model of real stages ([Note: lists played on a model of real stages]); `simulate` gives their
bubble (no closed form is claimed).

[Note: lists played on a model of real stages]
At one unit per action the scheduler optimises stages that do not exist: a real first stage's
``I`` computes nothing and its ``W`` is its whole backward, and the last stage carries the head
and loss (on the example Llama's measured times the unit-time ``zbv`` list simulated 5% longer
than torch's ``ScheduleZBVZeroBubble`` order). So the registered list is the best candidate among
the unit-time play and the plays under each preference (`PREFERENCES`), with and without a
reserved slot, on each cost model of `STAGE_MODELS` (first stage ``I`` = 0, ``W`` = ``I + W``;
``I : W`` = 1 : 1, 1.15 : 0.85 or 0.85 : 1.15; last stage 1 or 1.2 times the others). Best: the
least sum of `simulate`'s makespans over the models, among candidates no longer than the
unit-time play at unit times (so bounds proved at unit times hold); ties go to the unit-time
play. On the measured times that is 0.1% (``zbv``) and 0.4% (``interleaved_zb``) from torch's
order. Deterministic, built once per ``(p, m, v)`` per process ([Note: building the registered
lists]); `tune_schedule` refits a list to a run's measured times.

[Note: building the registered lists]
Up to 19 plays, each linear in the ``3 p v m`` actions ([Note: the play's events] in
``_schedule_greedy.py``). Most candidates are longer than the unit-time play at unit times, so
each play times its own list at unit times as it goes and stops once a rank's clock plus its
remaining actions exceeds the unit-time makespan. Plays of one model under other preferences
and reserve go on from where they first decide otherwise ([Note: plays that fork]), so a common
beginning is played once; plays are kept as integer keys and only the chosen list becomes
``Action`` s. The lists equal the plain algorithm's (``tests/test_pipeline_schedule_build.py``);
build times against torch's are in docs/benchmarks.md (``benchmarks/pipeline_zb.py --parts build``).
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
