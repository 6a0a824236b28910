"""The mixture-of-experts face of ``shardwise.composable``: the ``MoE`` layer and its parts, the
auxiliary losses, expert parallelism (``ExpertParallel``, ``fully_shard_experts``) and Hugging
Face MoE blocks. See docs/expert_parallel.md.

    from shardwise.composable.moe import MoE, ExpertParallel, fully_shard_experts
"""

from ._moe import (DispatchStats, ExpertParallel, ExpertTensorParallel, GroupedExperts, MoE, MoEStats, Routing,
                   SharedExperts, TopKRouter, expert_parallel_plan, fully_shard_experts, load_balancing_loss,
                   moe_from_hf, router_z_loss, sequence_load_balancing_loss, swap_hf_moe_blocks)

__all__ = [
    "MoE", "MoEStats", "SharedExperts", "GroupedExperts", "TopKRouter", "Routing",
    "load_balancing_loss", "sequence_load_balancing_loss", "router_z_loss",
    "ExpertParallel", "ExpertTensorParallel", "DispatchStats", "fully_shard_experts", "expert_parallel_plan",
    "moe_from_hf", "swap_hf_moe_blocks",
]
