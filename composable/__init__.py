"""shardwise.composable: ``fully_shard`` (FSDP / HSDP) on DTensor.

The names follow torch's FSDP2 so that switching is one import::

    from shardwise.composable import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._wrap import ShardingPolicy, ShardingStrategy, apply_fully_shard, select_units, strategy_mesh

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingPolicy",
    "ShardingStrategy",
    "apply_fully_shard",
    "select_units",
    "strategy_mesh",
]
