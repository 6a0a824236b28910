"""Context parallelism: the sequence of each sample sharded over a ``cp`` mesh axis in the
zigzag layout, attention across ranks by a ring (or an all-gather) of key/value blocks.
See docs/context_parallel.md."""

from ._attention import METHODS, context_parallel_attention
from ._loss import token_mean_loss
from ._positions import PositionsHandle, feed_positions
from ._route import RouteHandle, context_parallel, route_attention
from ._layout import shard_sequence, unshard_sequence, zigzag_chunks, zigzag_positions

__all__ = ["METHODS", "PositionsHandle", "RouteHandle", "context_parallel", "context_parallel_attention",
           "feed_positions", "route_attention", "shard_sequence", "token_mean_loss", "unshard_sequence",
           "zigzag_chunks", "zigzag_positions"]
