"""shardwise.composable: ``fully_shard`` (FSDP / HSDP) on DTensor, tensor, pipeline, context and
expert parallelism, and the memory planner.

The names follow torch's FSDP2 so that switching is one import::

    from shardwise.composable import fully_shard, FSDPModule, MixedPrecisionPolicy

Each parallelism has a face of its own, whose ``__all__`` is its user-facing names:
``shardwise.composable.fsdp`` (also ``replicate``, the strategies, ``clip_grad_norm_``),
``.tp``, ``.pipeline``, ``.cp``, ``.moe``, ``.optim`` (whole-matrix optimizers). Every name is
also here, flat; ``__all__`` is the
faces' names and the planner's. The pipeline names below the faces' level are importable
here too (they were exported before the faces), but are not in ``__all__``.
"""

from . import cp, fsdp, moe, optim, pipeline, tp
from .cp import *  # noqa: F403  the names in cp.__all__
from .fsdp import *  # noqa: F403
from .moe import *  # noqa: F403
from .optim import *  # noqa: F403
from .pipeline import *  # noqa: F403
from .tp import *  # noqa: F403
# importable for code written before the faces, not in __all__ (the pipeline's building blocks)
from ._pipeline import PLACEMENTS, RUNNABLE_KINDS, InFlight, balanced_bounds, uniform_bounds  # noqa: F401
from ._plan import (DEFAULT_KEPT_GRADS, MemoryPlan, MeshOptions, MeshSuggestion, PipelineMemoryPlan, PlanOptions,
                    UnitPlan, plan_memory, plan_pipeline_memory, suggest_mesh)

__all__ = ["plan_memory", "plan_pipeline_memory", "suggest_mesh", "PlanOptions", "MeshOptions", "MemoryPlan",
           "PipelineMemoryPlan", "MeshSuggestion", "UnitPlan", "DEFAULT_KEPT_GRADS"]
__all__ += fsdp.__all__
__all__ += tp.__all__
__all__ += pipeline.__all__
__all__ += cp.__all__
__all__ += moe.__all__
__all__ += optim.__all__
