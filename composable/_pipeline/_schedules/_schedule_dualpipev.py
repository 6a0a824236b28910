"""``dualpipev``: DeepSeek's DualPipeV order (the V-shaped DualPipe of the DeepSeek-V3 report).

Two stages per rank in a V ([Note: stage placement]: rank ``r`` holds ``r`` and ``2 p - 1 - r``),
``m >= 2 p``. Rank ``r``'s list, in eight phases: ``2 (p - r - 1)`` first-stage forwards; ``r + 1``
rounds of two forwards (first, then second stage); ``p - r - 1`` rounds of (second-stage ``I``,
a pending ``W``, a second-stage forward); ``m - 2 p + r + 1`` steady rounds of two ``FB`` pairs
([Note: action kinds]): (first-stage forward, second-stage backward) and (second-stage forward,
first-stage backward); ``p - r - 1`` rounds of a second-stage backward and a (second-stage
forward, first-stage backward) pair; ``r + 1`` rounds of two backwards (second, then first stage;
not a pair), the later half split into ``I`` and deferred ``W`` (from the middle, first stage
first on even ranks, second on odd); ``p - r - 1`` rounds of a pending ``W`` and a first-stage
backward; then the remaining ``W``s. A pair's halves never wait on each other, so an overlap
function may run them together ([Note: forward/backward pairs] in
``_pipeline/_runtime/_pipeline_schedule.py``). At most ``2 p`` microbatch-stages per rank up to
one; `simulate` proves the lists deadlock-free for every ``p``, ``m``, halves in either order.
"""

from __future__ import annotations

from collections import deque

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, register_schedule

__all__ = ["DUALPIPEV"]


def _build(rank: int, pp: int, m: int, v: int) -> list[Action]:
    first, second = rank, 2 * pp - 1 - rank
    acts: list[Action] = []
    next_f = {first: 0, second: 0}
    next_b = {first: 0, second: 0}
    weights: deque[Action] = deque()

    def forward(s: int) -> None:
        acts.append(Action(ActionKind.F, s, next_f[s]))
        next_f[s] += 1

    def backward(s: int, split: bool) -> None:
        i = next_b[s]
        next_b[s] += 1
        if split:
            acts.append(Action(ActionKind.I, s, i))
            weights.append(Action(ActionKind.W, s, i))
        else:
            acts.append(Action(ActionKind.B, s, i))

    def pair(f: int, b: int) -> None:  # an FB action: forward of stage f, full backward of stage b
        forward(f)
        backward(b, False)
        acts[-2:] = [Action.pair(acts[-2], acts[-1])]

    def one_weight() -> None:
        if weights:
            acts.append(weights.popleft())

    cool = pp - rank - 1
    for _ in range(2 * cool):
        forward(first)
    for _ in range(rank + 1):
        forward(first)
        forward(second)
    for _ in range(cool):
        backward(second, True)
        one_weight()
        forward(second)
    for _ in range(m - 2 * pp + rank + 1):
        pair(first, second)
        pair(second, first)
    for _ in range(cool):
        backward(second, False)
        pair(second, first)
    split = False
    half = (rank + 1) // 2
    for k in range(rank + 1):
        if k == half and rank % 2 == 1:
            split = True
        backward(second, split)
        if k == half and rank % 2 == 0:
            split = True
        backward(first, split)
    for _ in range(cool):
        one_weight()
        backward(first, split)
    while weights:
        one_weight()
    return acts


DUALPIPEV = register_schedule(ScheduleSpec(
    "dualpipev", _build, virtual=True, placement="v", exact_virtual_stages=2, min_microbatches_per_stage=True,
    summary="DeepSeek's DualPipeV: a V of two stages per rank, forward/backward pairs, zero-bubble tail"))
