"""``zb_h1`` (zero bubble, ZB-H1 order; issue 23): 1F1B with every backward split into ``I``
(input gradient, on the critical path) and ``W`` (weight gradients), rank ``r`` deferring ``r``
of its ``W`` s into the cool-down, where 1F1B idles.

Rank ``r``: ``pp - r - 1`` warm-up forwards; then per microbatch ``k`` one forward (while any
is left), ``I(k)``, and ``W(k - r)`` once ``r`` input gradients are ahead; the remaining ``W`` s
last. At most ``pp`` microbatches alive per rank (1F1B's peak) and, with equal F/I/W times, a
bubble of ``(p - 1) / (3 m + p - 1)``, about a third of 1F1B's (`tests/test_pipeline_zb.py`).
"""

from __future__ import annotations

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, register_schedule

__all__ = ["ZB_H1", "zb_h1_bubble"]


def zb_h1_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """``(p - 1) / (3 m + p - 1)``: idle fraction of a rank with forward 1, input gradient 1 and
    weight gradient 1 (a backward of 2 split in halves), for ``m >= p``."""
    return (pp - 1) / (3 * microbatches + pp - 1)


def _build(rank: int, pp: int, m: int, v: int) -> list[Action]:
    warm = min(pp - rank - 1, m)
    acts = [Action(ActionKind.F, rank, i) for i in range(warm)]
    w = 0
    for k in range(m):
        if warm + k < m:
            acts.append(Action(ActionKind.F, rank, warm + k))
        acts.append(Action(ActionKind.I, rank, k))
        if k - w >= rank:
            acts.append(Action(ActionKind.W, rank, w))
            w += 1
    return acts + [Action(ActionKind.W, rank, i) for i in range(w, m)]


ZB_H1 = register_schedule(ScheduleSpec("zb_h1", _build, bubble=zb_h1_bubble,
                     summary="1F1B with split backwards, rank r deferring r weight gradients (ZB-H1)"))
