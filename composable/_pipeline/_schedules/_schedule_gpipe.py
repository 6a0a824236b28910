"""``gpipe``: every forward, then every backward; keeps ``m`` microbatches alive."""

from __future__ import annotations

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, one_f_one_b_bubble, register_schedule

__all__ = ["GPIPE"]


def _build(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return [Action(ActionKind.F, rank, i) for i in range(m)] + [Action(ActionKind.B, rank, i) for i in range(m)]


GPIPE = register_schedule(ScheduleSpec("gpipe", _build, bubble=one_f_one_b_bubble,
                                       summary="all forwards, then all backwards"))
