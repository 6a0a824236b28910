"""The replicate wing: data parallelism with whole, plain parameters (DDP's way), composable.

`replicate` is what the NO_SHARD strategy uses when no cast or offload is asked for; it
imports only the shared leaves of ``composable`` (docs/architecture.md)."""

from ._module import ReplicateModule
from ._replicate import replicate

__all__ = ["ReplicateModule", "replicate"]
