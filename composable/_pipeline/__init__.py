"""Pipeline parallelism: balanced automatic partitioning, GPipe / 1F1B / interleaved 1F1B
schedules and the zero-bubble ones (zb_h1, zbv, interleaved_zb, dualpipev with its forward/backward
pairs and an overlap hook; a registry of schedule specs), composed with ``fully_shard`` and tensor
parallelism. See docs/pipeline.md.

Rooms, lowest first (`ROOMS`): ``_schedules`` (pure: action lists, registry, `simulate`),
``_split`` (the model cut into stages), ``_runtime`` (`PipelineSchedule`). A room imports only
rooms below it, and those only through their ``__init__``. Besides the user-facing names of
``__all__``, this package exports what ``shardwise.composable`` re-exports and what the planner
(``_plan``) uses."""

from ._runtime import RUNNABLE_KINDS, PairHalves, PipelineError, PipelineSchedule, retune
from ._schedules import (PLACEMENTS, SCHEDULES, TUNABLE_SCHEDULES, Action, ActionKind, InFlight, ScheduleSpec,
                         activations_in_flight, build_schedule, get_schedule, register_schedule, simulate, stage_rank,
                         theoretical_bubble, tune_schedule, unregister_schedule, walk_in_flight)
from ._split import (PipelineSplit, StagePlan, balanced_bounds, pipeline_optimizer_state_dict, pipeline_split,
                     pipeline_state_dict, plan_stages, set_pipeline_optimizer_state_dict, set_pipeline_state_dict,
                     uniform_bounds)

ROOMS = ("_schedules", "_split", "_runtime")
"""The rooms of ``_pipeline``, lowest first: each imports only those before it."""

__all__ = ["Action", "ActionKind", "PairHalves", "PipelineError", "PipelineSchedule", "PipelineSplit", "SCHEDULES",
           "ScheduleSpec", "StagePlan", "TUNABLE_SCHEDULES", "activations_in_flight", "build_schedule", "get_schedule",
           "pipeline_optimizer_state_dict", "pipeline_split", "pipeline_state_dict", "plan_stages",
           "register_schedule", "retune", "set_pipeline_optimizer_state_dict", "set_pipeline_state_dict", "simulate",
           "stage_rank", "theoretical_bubble", "tune_schedule", "unregister_schedule"]
