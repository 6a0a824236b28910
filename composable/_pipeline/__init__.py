"""Pipeline parallelism: balanced automatic partitioning, GPipe / 1F1B / interleaved 1F1B
schedules, composed with ``fully_shard`` and tensor parallelism. See docs/pipeline.md."""

from ._checkpoint import (pipeline_optimizer_state_dict, pipeline_state_dict, set_pipeline_optimizer_state_dict,
                          set_pipeline_state_dict)
from ._partition import StagePlan, balanced_bounds, uniform_bounds
from ._runtime import PipelineError, PipelineSchedule
from ._schedule import SCHEDULES, build_schedule, simulate, theoretical_bubble
from ._stages import PipelineSplit, pipeline_split, plan_stages

__all__ = [
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
    "simulate",
    "theoretical_bubble",
    "uniform_bounds",
]
