"""The pipeline face of ``shardwise.composable``: splitting a model into stages, the runtime
``PipelineSchedule``, the schedules (built in, registered, tuned), their simulation and the
activations they keep alive, the pipeline's state dicts. See docs/pipeline.md.

    from shardwise.composable.pipeline import PipelineSchedule, pipeline_split
"""

from ._pipeline import (SCHEDULES, TUNABLE_SCHEDULES, Action, ActionKind, PairHalves, PipelineError, PipelineSchedule,
                        PipelineSplit, ScheduleSpec, StagePlan, activations_in_flight, build_schedule, get_schedule,
                        pipeline_optimizer_state_dict, pipeline_split, pipeline_state_dict, plan_stages,
                        register_schedule, retune, set_pipeline_optimizer_state_dict, set_pipeline_state_dict,
                        simulate, stage_rank, theoretical_bubble, tune_schedule, unregister_schedule)

__all__ = [
    "pipeline_split", "PipelineSplit", "plan_stages", "StagePlan", "PipelineSchedule", "PipelineError", "PairHalves",
    "SCHEDULES", "ScheduleSpec", "get_schedule", "register_schedule", "unregister_schedule",
    "Action", "ActionKind", "build_schedule", "stage_rank", "simulate", "theoretical_bubble", "activations_in_flight",
    "TUNABLE_SCHEDULES", "tune_schedule", "retune",
    "pipeline_state_dict", "set_pipeline_state_dict", "pipeline_optimizer_state_dict",
    "set_pipeline_optimizer_state_dict",
]
