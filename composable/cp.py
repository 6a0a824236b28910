"""The context-parallel face of ``shardwise.composable``: the sequence sharded over a ``cp`` axis
(zigzag layout), attention across ranks, the loss over sharded tokens. See
docs/context_parallel.md.

    from shardwise.composable.cp import context_parallel, shard_sequence
"""

from ._cp import (METHODS, PositionsHandle, RouteHandle, context_parallel, context_parallel_attention, feed_positions,
                  route_attention, shard_sequence, token_mean_loss, unshard_sequence, zigzag_chunks, zigzag_positions)

__all__ = ["context_parallel", "context_parallel_attention", "METHODS", "shard_sequence", "unshard_sequence",
           "zigzag_chunks", "zigzag_positions", "feed_positions", "PositionsHandle", "route_attention", "RouteHandle",
           "token_mean_loss"]
