"""How many microbatches of activations each rank holds at once, from a schedule's action lists (pure).

[Note: activations in flight]
Walk rank ``r``'s action list counting, per virtual stage, the microbatches whose activations are
alive (``F`` adds one, ``B`` or ``W`` frees it, ``I`` nothing: [Note: action kinds] in
``_actions.py``). After each action the rank holds ``sum_s alive_s * weight_s`` microbatch-units,
``weight_s`` being stage ``s``'s share of the rank's layers (default ``1 / v``); the peak is what
it must hold (1F1B's rank ``r``: ``min(pp - r, m)``; GPipe: ``m``; interleaved 1F1B at ``pp=4,
v=2``: 2.5 on its last rank). Boundary buffers in transit are not counted. A pair (``FB``) counts
as its forward, then its backward: the higher peak of the two orders the runtime may run.

A split backward also holds, between ``I`` and ``W``, the gradient that reached each frontier
source ([Note: split backward] in ``_pipeline/_split/_split_backward.py``). ``kept_grads`` counts
it: ``I`` adds ``kept_grads`` units on its stage (none on stage 0) and ``W`` frees them. It is the
stage's kept gradient bytes over its activation bytes per microbatch, a property of the model
(0.36-0.62 measured on the example Llama: `PipelineSchedule.last_kept_grad_bytes`,
``benchmarks/pipeline_zb.py --parts memory``); the default 0 counts activations alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._actions import Action, ActionKind
from ._placement import stages_of
from ._registry import ScheduleSpec, get_schedule
from ._simulate import build_schedule

__all__ = ["InFlight", "activations_in_flight", "walk_in_flight"]


@dataclass(frozen=True)
class InFlight:
    """Peak activations alive, from the action lists (see [Note: activations in flight]).

    ``per_rank[r]``: rank ``r``'s peak in microbatch-units of its blocks; ``per_stage[s]``: the
    peak number of microbatches alive on virtual stage ``s`` (on its own)."""

    per_rank: tuple[float, ...]
    per_stage: tuple[int, ...]


def walk_in_flight(actions: Sequence[Action], weights: dict[int, float],
                   kept_grads: float = 0.0) -> tuple[float, dict[int, int]]:
    """One rank's peak weighted activations (with ``kept_grads`` units per microbatch between its
    ``I`` and ``W``) and each of its stages' peak count of microbatches alive."""
    alive: dict[int, int] = {s: 0 for s in weights}
    peak_stage = dict(alive)
    level = peak = 0.0
    for a in (h for x in actions for h in x.halves):
        if a.kind is ActionKind.F:
            delta, units = 1, 1.0
        elif a.kind is ActionKind.I:  # the first stage's I has no input gradient: it keeps nothing
            delta, units = 0, kept_grads if a.stage > 0 else 0.0
        elif a.kind is ActionKind.W:
            delta, units = -1, -1.0 - (kept_grads if a.stage > 0 else 0.0)
        elif a.kind.frees_activations:
            delta, units = -1, -1.0
        else:
            continue
        if a.stage not in alive:
            raise ValueError(f"pipeline: action {a!r} is on a stage with no weight (weights for {sorted(weights)})")
        alive[a.stage] += delta
        if alive[a.stage] < 0:
            raise ValueError(f"pipeline: action {a!r} frees activations of a microbatch that has none alive")
        peak_stage[a.stage] = max(peak_stage[a.stage], alive[a.stage])
        level += units * weights[a.stage]
        peak = max(peak, level)
    return peak, peak_stage


def activations_in_flight(schedule: str | ScheduleSpec, pp: int, microbatches: int, virtual_stages: int = 1,
                          stage_weights: Sequence[float] | None = None, *, kept_grads: float = 0.0) -> InFlight:
    """Peak activations alive per rank and per virtual stage under ``schedule``.

    ``stage_weights[s]``: virtual stage ``s``'s share of its rank's blocks (``pp * v`` values;
    those of one rank should sum to 1); default ``1 / virtual_stages`` each. ``kept_grads``: the
    gradients a split backward keeps from ``I`` to ``W``, in units of the microbatch's
    activations on its stage (default 0: not counted). See [Note: activations in flight]."""
    if not kept_grads >= 0:
        raise ValueError(f"pipeline: kept_grads={kept_grads!r}; it is a size ratio, >= 0 (0 counts activations only)")
    v = virtual_stages
    acts = build_schedule(schedule, pp, microbatches, v)
    if stage_weights is None:
        stage_weights = [1.0 / v] * (pp * v)
    if len(stage_weights) != pp * v:
        raise ValueError(f"pipeline: {len(stage_weights)} stage weights for pp ({pp}) x virtual_stages ({v}) = "
                         f"{pp * v} stages")
    per_rank: list[float] = []
    per_stage = [0] * (pp * v)
    for r in range(pp):
        mine = stages_of(r, pp, v, get_schedule(schedule).placement)
        peak, stages = walk_in_flight(acts[r], {s: stage_weights[s] for s in mine}, kept_grads)
        per_rank.append(peak)
        for s, n in stages.items():
            per_stage[s] = n
    return InFlight(tuple(per_rank), tuple(per_stage))
