"""``zbv`` and ``interleaved_zb``: zero-bubble lists over several stages per rank.

``zbv`` (the ZB-V schedule): two stages per rank in a V ([Note: stage placement]: rank ``r``
holds stages ``r`` and ``2 p - 1 - r``), every backward split into ``I`` and ``W``, at most
``2 p`` microbatch-stages alive per rank (1F1B's ``p`` microbatches of the rank's layers).
``interleaved_zb``: ``v`` stages per rank in the loop placement, split backwards, each rank's
peak activations capped at interleaved 1F1B's (``min(2 (p - r - 1) + (v - 1) p + 1, v m)``
microbatch-stages). Both lists come from the list scheduler of [Note: greedy zero-bubble
lists] in ``_schedule_greedy.py``; `simulate` gives their bubble (no closed form is claimed).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from ._actions import Action
from ._registry import ScheduleSpec, register_schedule
from ._schedule_greedy import greedy_lists

__all__ = ["INTERLEAVED_ZB", "ZBV", "izb_cap", "zbv_cap"]


def zbv_cap(pp: int, m: int, v: int) -> Callable[[int], int]:
    """ZBV's cap per rank, in microbatch-stages: ``2 p`` (1F1B's ``p`` microbatches of a rank)."""
    return lambda r: 2 * pp


def izb_cap(pp: int, m: int, v: int) -> Callable[[int], int]:
    """Interleaved ZB's cap per rank: interleaved 1F1B's peak, ``min(2 (p - r - 1) + (v - 1) p + 1, v m)``."""
    return lambda r: max(v, min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m))


@lru_cache(maxsize=64)
def _zbv_lists(pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, greedy_lists(pp, m, 2, "v", zbv_cap(pp, m, 2))))


@lru_cache(maxsize=64)
def _izb_lists(pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, greedy_lists(pp, m, v, "loop", izb_cap(pp, m, v))))


ZBV = register_schedule(ScheduleSpec(
    "zbv", lambda r, pp, m, v: list(_zbv_lists(pp, m)[r]), virtual=True, placement="v", exact_virtual_stages=2,
    summary="two stages per rank in a V, split backwards, 1F1B's peak activations (ZB-V)"))
INTERLEAVED_ZB = register_schedule(ScheduleSpec(
    "interleaved_zb", lambda r, pp, m, v: list(_izb_lists(pp, m, v)[r]), virtual=True,
    summary="v stages per rank, split backwards, interleaved 1F1B's peak activations"))
