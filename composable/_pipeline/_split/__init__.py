"""Splitting a model into pipeline stages: block costs, the balanced partition, the split
itself (`pipeline_split`, `PipelineSplit`), agreement of the ranks on it, the split backward
(``I`` / ``W`` from one autograd graph) and the state dicts of a split. Above ``_schedules``
(it places stages), below ``_runtime``."""

from ._checkpoint import (pipeline_optimizer_state_dict, pipeline_state_dict, set_pipeline_optimizer_state_dict,
                          set_pipeline_state_dict)
from ._graph_split import SplitCache
from ._partition import StagePlan, balanced_bounds, uniform_bounds
from ._split import StageShell
from ._split_backward import input_grad, weight_grad
from ._stages import PipelineSplit, pipeline_split, plan_stages

__all__ = ["PipelineSplit", "SplitCache", "StagePlan", "StageShell", "balanced_bounds", "input_grad",
           "pipeline_optimizer_state_dict", "pipeline_split", "pipeline_state_dict", "plan_stages",
           "set_pipeline_optimizer_state_dict", "set_pipeline_state_dict", "uniform_bounds", "weight_grad"]
