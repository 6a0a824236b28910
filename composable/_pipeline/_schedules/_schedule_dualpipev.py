"""``dualpipev``: DeepSeek's DualPipeV order (the V-shaped DualPipe of the DeepSeek-V3 report).

Two stages per rank in a V ([Note: stage placement]: rank ``r`` holds ``r`` and ``2 p - 1 - r``),
``m >= 2 p``. Rank ``r``'s list, in eight phases: ``2 (p - r - 1)`` forwards of its first stage;
``r + 1`` rounds of two forwards (first stage, then second); ``p - r - 1`` rounds of "input gradient
of the second stage, one pending weight gradient, a forward of the second stage"; the steady
state of ``m - 2 p + r + 1`` rounds of two forward/backward pairs, each one ``FB`` action
([Note: action kinds]) — (forward of the first stage, full backward of the second) and (forward
of the second, full backward of the first); ``p - r - 1`` rounds of a backward of the second
stage and a (second-stage forward, first-stage backward) ``FB`` pair; ``r + 1`` rounds of two
backwards (second stage, then first; two actions, not a pair), whose later half splits into
``I`` and deferred ``W`` (from the middle, on the first stage first on even ranks, on the second
on odd ones); ``p - r - 1`` rounds of a pending ``W`` and a backward of the first stage; then
the remaining ``W``s. An ``FB`` pair's halves never wait on each other, so an overlap function
can run them together (DualPipe overlaps one half's all-to-all with the other's compute:
`PipelineSchedule`'s ``overlap``); without one the runtime runs them one after the other, the
one whose input is there first going first ([Note: forward/backward pairs] in
``_pipeline/_runtime/_pipeline_schedule.py``).
Activations: at most ``2 p`` microbatch-stages per rank (1F1B's peak) up to one; `simulate`
proves the lists deadlock-free for every ``p``, ``m``, with the pairs' halves in either order or
run together.
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
