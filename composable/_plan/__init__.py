"""The planning wing: memory per rank and a mesh for a cluster, from shapes alone (the model
may be on the meta device). It sits above the other wings and is imported by none of them."""

from ._options import MeshOptions, PlanOptions
from ._pipeline import DEFAULT_KEPT_GRADS, PipelineMemoryPlan, plan_pipeline_memory
from ._planner import MeshSuggestion, plan_memory, suggest_mesh
from ._units import MemoryPlan, UnitPlan

__all__ = ["DEFAULT_KEPT_GRADS", "MemoryPlan", "MeshOptions", "MeshSuggestion", "PipelineMemoryPlan", "PlanOptions",
           "UnitPlan", "plan_memory", "plan_pipeline_memory", "suggest_mesh"]
