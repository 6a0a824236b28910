"""Pipeline parallelism: balanced automatic partitioning, GPipe / 1F1B / interleaved 1F1B
schedules and the zero-bubble ones (zb_h1, zbv, interleaved_zb, dualpipev with its forward/backward
pairs and an overlap hook; a registry of schedule specs), composed with ``fully_shard`` and tensor
parallelism. See docs/pipeline.md."""

from ._checkpoint import (pipeline_optimizer_state_dict, pipeline_state_dict, set_pipeline_optimizer_state_dict,
                          set_pipeline_state_dict)
from ._in_flight import InFlight, activations_in_flight
from ._in_flight import walk_in_flight  # for the planner (_plan)
from ._pairs import PairHalves
from ._partition import StagePlan, balanced_bounds, uniform_bounds
from ._placement import PLACEMENTS, stage_rank
from ._registry import ScheduleSpec, get_schedule, register_schedule, unregister_schedule
from ._runtime import RUNNABLE_KINDS, PipelineError, PipelineSchedule
from ._schedule import SCHEDULES, Action, ActionKind, build_schedule, simulate, theoretical_bubble
from ._schedule_tuned import TUNABLE_SCHEDULES, tune_schedule
from ._stages import PipelineSplit, pipeline_split, plan_stages
from ._tune import retune

__all__ = [
    "Action",
    "ActionKind",
    "RUNNABLE_KINDS",
    "ScheduleSpec",
    "InFlight",
    "activations_in_flight",
    "get_schedule",
    "PLACEMENTS",
    "stage_rank",
    "register_schedule",
    "unregister_schedule",
    "PairHalves",
    "PipelineError",
    "PipelineSchedule",
    "PipelineSplit",
    "SCHEDULES",
    "StagePlan",
    "balanced_bounds",
    "build_schedule",
    "pipeline_optimizer_state_dict",
    "pipeline_split",
    "pipeline_state_dict",
    "set_pipeline_optimizer_state_dict",
    "set_pipeline_state_dict",
    "plan_stages",
    "retune",
    "simulate",
    "theoretical_bubble",
    "TUNABLE_SCHEDULES",
    "tune_schedule",
    "uniform_bounds",
]
