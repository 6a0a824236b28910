"""The replicate wing: data parallelism with whole, plain parameters (DDP's way), composable; what
NO_SHARD uses when no cast or offload is asked for."""

from ._module import ReplicateModule
from ._replicate import replicate

__all__ = ["ReplicateModule", "replicate"]
