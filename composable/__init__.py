"""shardwise.composable: ``fully_shard`` (FSDP / HSDP) on DTensor.

The names follow torch's FSDP2 so that switching is one import::

    from shardwise.composable import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from ._fsdp import (AllGather, CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                    ReduceScatter, UnshardHandle, broadcast_from_rank0, fully_shard, materialize,
                    register_fsdp_forward_method, share_comm_ctx)
from ._clip_grad import clip_grad_norm_
from ._replicate import ReplicateModule, replicate
from ._tp import *  # noqa: F403  tensor parallelism: the names in _tp.__all__
from ._tp import __all__ as _tp_all
from ._pipeline import *  # noqa: F403  pipeline parallelism: the names in _pipeline.__all__
from ._pipeline import __all__ as _pipeline_all
from ._wrap import (AccelerateConfig, ShardingPolicy, ShardingStrategy, apply_fully_shard, from_accelerate_config,
                    select_units, strategy_mesh)
from ._cp import *  # noqa: F403  context parallelism: the names in _cp.__all__
from ._cp import __all__ as _cp_all
from ._moe import *  # noqa: F403  mixture of experts, expert parallelism: the names in _moe.__all__
from ._moe import __all__ as _moe_all
from ._plan import DEFAULT_KEPT_GRADS, MemoryPlan, MeshSuggestion, UnitPlan, plan_memory, suggest_mesh

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "AllGather",
    "ReduceScatter",
    "materialize",
    "replicate",
    "ReplicateModule",
    "broadcast_from_rank0",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "ShardingPolicy",
    "ShardingStrategy",
    "apply_fully_shard",
    "select_units",
    "strategy_mesh",
    "AccelerateConfig",
    "from_accelerate_config",
    "clip_grad_norm_",
    "plan_memory",
    "suggest_mesh",
    "MemoryPlan",
    "MeshSuggestion",
    "UnitPlan",
    "DEFAULT_KEPT_GRADS",
]
__all__ += _tp_all
__all__ += _pipeline_all
__all__ += _cp_all
__all__ += _moe_all
