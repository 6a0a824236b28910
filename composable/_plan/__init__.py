"""The planning wing: memory per rank and a mesh for a cluster, from shapes alone (the model
may be on the meta device). It sits above the other wings and is imported by none of them."""

from ._pipeline import DEFAULT_KEPT_GRADS, PipelineMemoryPlan
from ._planner import MeshSuggestion, plan_memory, suggest_mesh
from ._units import MemoryPlan, UnitPlan

__all__ = ["DEFAULT_KEPT_GRADS", "MemoryPlan", "MeshSuggestion", "PipelineMemoryPlan", "UnitPlan", "plan_memory", "suggest_mesh"]
