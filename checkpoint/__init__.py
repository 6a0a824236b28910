"""shardwise.checkpoint: reshardable safetensors checkpoints.

Not built yet (tracked as its own issue); this package exports nothing so far.
"""

__all__: list[str] = []
