"""`ShardState`: where a unit's parameters are, and the transitions they may make (checked by
``ParamGroup._to``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["ShardState", "NEXT"]


class ShardState(Enum):
    """Where a unit's parameters are. Transitions (checked):

    SHARDED -> GATHERING (``unshard``: all-gather issued) -> UNSHARDED (``wait_unshard``) ->
    SHARDED or SHARDED_POST_FORWARD (``reshard``); SHARDED_POST_FORWARD -> GATHERING (the
    cheaper all-gather over the smaller group) or -> SHARDED (the kept rows dropped)."""

    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"  # sharded, plus 1/k of the rows kept
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


NEXT = {
    ShardState.SHARDED: (ShardState.GATHERING,),
    ShardState.SHARDED_POST_FORWARD: (ShardState.GATHERING, ShardState.SHARDED),
    ShardState.GATHERING: (ShardState.UNSHARDED,),
    ShardState.UNSHARDED: (ShardState.SHARDED, ShardState.SHARDED_POST_FORWARD),
}
