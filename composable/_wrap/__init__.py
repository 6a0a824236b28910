"""The wrapping wing: which modules become units (a `ShardingPolicy`) and how they are
sharded (a `ShardingStrategy`, Accelerate's names), and Accelerate's FSDP config read into
both (``_accelerate.py`` reads it, ``_accelerate_config.py`` holds and applies it). Built on
the fully_shard wing's public names only.
"""

from ._accelerate_config import AccelerateConfig, broadcast_from_rank0, from_accelerate_config
from ._policy import ShardingPolicy, apply_fully_shard, select_units, strategy_mesh
from ._strategies import STRATEGIES, ShardingStrategy, StrategySpec

__all__ = ["AccelerateConfig", "STRATEGIES", "ShardingPolicy", "ShardingStrategy", "StrategySpec", "apply_fully_shard",
           "broadcast_from_rank0", "from_accelerate_config", "select_units", "strategy_mesh"]
