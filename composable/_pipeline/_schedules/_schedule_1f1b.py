"""``1f1b``: ``pp - r - 1`` warm-up forwards on rank ``r``, then one forward / one backward
alternately, then the remaining backwards. GPipe's bubble, at most ``pp - r`` microbatches alive."""

from __future__ import annotations

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, one_f_one_b_bubble, register_schedule

__all__ = ["ONE_F_ONE_B"]


def _build(rank: int, pp: int, m: int, v: int) -> list[Action]:
    warm = min(pp - rank - 1, m)
    fw = [Action(ActionKind.F, rank, i) for i in range(m)]
    bw = [Action(ActionKind.B, rank, i) for i in range(m)]
    acts = fw[:warm]
    for k in range(m - warm):
        acts += [fw[warm + k], bw[k]]
    return acts + bw[m - warm:]


ONE_F_ONE_B = register_schedule(ScheduleSpec("1f1b", _build, bubble=one_f_one_b_bubble,
                                             summary="warm-up forwards, then one forward / one backward"))
