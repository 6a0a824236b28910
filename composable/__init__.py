"""shardwise.composable: ``fully_shard`` (FSDP / HSDP) on DTensor.

The names follow torch's FSDP2 so that switching is one import::

    from shardwise.composable import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from ._clip_grad import clip_grad_norm_
from ._materialize import broadcast_from_rank0, materialize
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._tp import (parallelize_module, ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput, ModuleParallel, ModuleRule, TPRegistry, DEFAULT_REGISTRY, ApplyContext, PlanError, loss_parallel, vocab_parallel_cross_entropy, local_shard_range, to_local_share)  # noqa: E501  tensor parallelism
from ._planner import MemoryPlan, MeshSuggestion, UnitPlan, plan_memory, suggest_mesh
from ._wrap import ShardingPolicy, ShardingStrategy, apply_fully_shard, select_units, strategy_mesh

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "materialize",
    "broadcast_from_rank0",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingPolicy",
    "ShardingStrategy",
    "apply_fully_shard",
    "select_units",
    "strategy_mesh",
    "clip_grad_norm_",
    "plan_memory",
    "suggest_mesh",
    "MemoryPlan",
    "MeshSuggestion",
    "UnitPlan",
    # tensor parallelism (composable/_tp)
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "ModuleParallel",
    "ModuleRule",
    "TPRegistry",
    "DEFAULT_REGISTRY",
    "ApplyContext",
    "PlanError",
    "loss_parallel",
    "vocab_parallel_cross_entropy",
    "local_shard_range",
    "to_local_share",
]
