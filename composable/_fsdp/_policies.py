"""Configuration objects of ``fully_shard`` (frozen dataclasses, FSDP2's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used around the sharded fp32 master parameters.

    * ``param_dtype``: dtype of the all-gathered (unsharded) parameters used in compute.
    * ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce.
    * ``output_dtype``: dtype the unit's floating-point outputs are cast to.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    * ``buffer_dtype``: dtype of the unit's floating-point buffers (FSDP2 has none).

    ``None`` means "keep the original dtype". The default policy changes nothing.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    buffer_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; the optimizer steps on CPU.

    ``pin_memory=None`` pins host memory only when an accelerator exists.
    """

    pin_memory: bool | None = None


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which axes of a whole SPMD mesh are data-parallel, for ``fully_shard(mesh=spmd_mesh,
    dp_mesh_dims=...)`` (FSDP2's name). ``shard``: the axis fully_shard shards over;
    ``replicate``: the HSDP replica axis. Each is an axis name, or a tuple of names flattened
    into one axis (called ``"_".join(names)``, as FSDP2's). At least one must be set."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: set shard= and/or replicate= to axis names of the mesh")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)
