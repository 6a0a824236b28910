"""Running a pipeline step: `PipelineSchedule` (one class, one file), what a step's actions
share, the messages between stages (transport, wire format, arrival), the check of a stage
boundary, ``fully_shard`` units within a step, and `retune`. The top room of ``_pipeline``."""

from ._pipeline_schedule import RUNNABLE_KINDS, PairHalves, PipelineSchedule
from ._step_state import PipelineError
from ._tune import retune

__all__ = ["PairHalves", "PipelineError", "PipelineSchedule", "RUNNABLE_KINDS", "retune"]
