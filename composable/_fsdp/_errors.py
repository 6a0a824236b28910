"""The exception ``fully_shard`` raises where torch's FSDP2 raises ``AssertionError``."""

from __future__ import annotations

__all__ = ["FullyShardUsageError"]


class FullyShardUsageError(ValueError, AssertionError):
    """A call of ``fully_shard`` that FSDP2 refuses with an ``AssertionError``: applying it twice
    to the same module, or a ``shard_placement_fn`` returning ``Shard(d)`` with ``d`` outside the
    parameter's dims. Both a ``ValueError`` (bad input, as shardwise reports it) and an
    ``AssertionError`` (what code written for FSDP2 catches)."""
