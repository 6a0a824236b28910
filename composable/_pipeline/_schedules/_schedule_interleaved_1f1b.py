"""``interleaved_1f1b`` (Megatron's order; ``m`` a multiple of ``pp``): the forwards of a rank
walk its ``v`` stages in rounds of ``pp`` microbatches; ``(pp - r - 1) * 2 + (v - 1) * pp``
warm-up forwards, then 1F1B, the backwards walking the stages in reverse. Bubble divided by ``v``."""

from __future__ import annotations

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, one_f_one_b_bubble, register_schedule

__all__ = ["INTERLEAVED_1F1B"]


def _build(rank: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v

    def fwd(k: int) -> Action:
        chunk = (k // pp) % v
        return Action(ActionKind.F, chunk * pp + rank, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action(ActionKind.B, chunk * pp + rank, (k // (pp * v)) * pp + k % pp)

    warm = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    acts = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        acts += [fwd(warm + k), bwd(k)]
    return acts + [bwd(k) for k in range(total - warm, total)]


INTERLEAVED_1F1B = register_schedule(ScheduleSpec("interleaved_1f1b", _build, virtual=True,
                                                  microbatch_multiple_of_pp=True, bubble=one_f_one_b_bubble,
                                                  summary="Megatron's interleaved order over v stages per rank"))
