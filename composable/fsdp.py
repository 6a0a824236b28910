"""The data-parallel face of ``shardwise.composable``: ``fully_shard`` (FSDP / HSDP), its module
and handles, the policies, ``replicate`` (DDP), the strategy table and ``apply_fully_shard``,
``clip_grad_norm_``. See docs/fully_shard.md and docs/strategies.md.

    from shardwise.composable.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from ._clip_grad import clip_grad_norm_
from ._fsdp import (AllGather, CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, FullyShardUsageError,
                    MixedPrecisionPolicy, OffloadPolicy, ReduceScatter, UnshardHandle, fully_shard, materialize,
                    register_fsdp_forward_method, share_comm_ctx)
from ._replicate import ReplicateModule, replicate
from ._wrap import (AccelerateConfig, ShardingPolicy, ShardingStrategy, apply_fully_shard, broadcast_from_rank0,
                    from_accelerate_config, select_units, strategy_mesh)

__all__ = [
    "fully_shard", "FSDPModule", "UnshardHandle", "FullyShardUsageError", "register_fsdp_forward_method",
    "share_comm_ctx", "AllGather", "ReduceScatter", "materialize", "broadcast_from_rank0",
    "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims",
    "replicate", "ReplicateModule",
    "ShardingPolicy", "ShardingStrategy", "apply_fully_shard", "select_units", "strategy_mesh",
    "AccelerateConfig", "from_accelerate_config",
    "clip_grad_norm_",
]
