"""The wrapping wing: which modules become units (a `ShardingPolicy`) and how they are
sharded (a `ShardingStrategy`, Accelerate's names), and Accelerate's FSDP config read into
both (``_accelerate.py`` reads it, ``_accelerate_config.py`` holds and applies it). Built on
the fully_shard wing's public names only.

[Note: ShardingPolicy.from_accelerate]
The policy is defined below the Accelerate reader (which builds policies), so the reader's
classmethod is attached here, where both are known; neither module imports the other back.
"""

from ._accelerate import AccelerateConfig, from_accelerate_config
from ._policy import ShardingPolicy, apply_fully_shard, select_units, strategy_mesh
from ._strategies import STRATEGIES, ShardingStrategy, StrategySpec


def _from_accelerate(cls, config: dict) -> ShardingPolicy:
    """A policy from Accelerate's FSDP config (its ``fsdp_config`` keys, with or without the
    ``fsdp_`` prefix, or the whole YAML as a dict). Keys that a policy cannot carry
    (``sync_module_states``, activation checkpointing, ...) are refused unless they ask for
    the default: use ``from_accelerate_config(config).apply(model)`` for those. See
    docs/accelerate.md for every key."""
    return from_accelerate_config(config).policy_only()


ShardingPolicy.from_accelerate = classmethod(_from_accelerate)  # type: ignore[attr-defined]

__all__ = ["AccelerateConfig", "STRATEGIES", "ShardingPolicy", "ShardingStrategy", "StrategySpec", "apply_fully_shard",
           "from_accelerate_config", "select_units", "strategy_mesh"]
