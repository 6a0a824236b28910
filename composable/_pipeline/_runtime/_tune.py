"""`retune`: rebuild a running `PipelineSchedule` with lists fitted to its own measured step.

A collective ([Note: schedules tuned to measured costs] in ``_pipeline/_schedules/_schedule_tuned.py``):
gathers `PipelineSchedule.last_action_times` over ``pp``, fits with `tune_schedule`, closes the old
schedule and returns a new one with the same settings. On CUDA pass ``costs`` timed with events.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from .._schedules import tune_schedule
from ._pipeline_schedule import PipelineSchedule

__all__ = ["retune"]


def retune(schedule: PipelineSchedule, *, costs: Mapping[tuple[str, int], float] | None = None,
           comm_time: float = 0.0, clock: str = "wall") -> PipelineSchedule:
    """A `PipelineSchedule` like ``schedule`` (same split and settings) whose lists fit ``costs``
    (default: its last step's `PipelineSchedule.last_action_times`, ``clock`` ``"wall"`` or
    ``"cpu"``, from every pp rank); ``comm_time``: seconds per message. ``schedule`` is closed."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"retune: clock={clock!r}; use 'wall' or 'cpu'")
    split = schedule.split
    if costs is None:
        which = 0 if clock == "wall" else 1
        mine = {k: v[which] for k, v in schedule.last_action_times.items()}
        got: list = [mine]
        if split.pp_size > 1:
            got = [None] * split.pp_size
            dist.all_gather_object(got, mine, group=split.pp_group)
        costs = {k: v for d in got for k, v in d.items()}
    name = schedule.schedule.name.split(":")[0]
    tuned = tune_schedule(name, split.pp_size, schedule.m, split.virtual_stages, costs, comm_time=comm_time)
    schedule.close()
    return PipelineSchedule(split, schedule=tuned, microbatches=schedule.m, loss_fn=schedule.loss_fn,
                            loss_context=schedule.loss_context,
                            reduce_every_microbatch=schedule.reduce_every_microbatch,
                            reshard_between_microbatches=schedule.reshard_between_microbatches,
                            overlap=schedule.overlap)
