"""The planner's options: `PlanOptions` for `plan_memory` / `plan_pipeline_memory`, `MeshOptions`
for `suggest_mesh`. Frozen; the functions also take the fields as keywords (today's calls), which
override the options given (``dataclasses.replace``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch

from .._fsdp import MixedPrecisionPolicy
from .._wrap import ShardingPolicy, ShardingStrategy

__all__ = ["PlanOptions", "MeshOptions", "with_overrides"]


@dataclass(frozen=True)
class PlanOptions:
    """What `plan_memory` plans a model's layout with, besides the mesh shape (each field in
    docs/planner.md): the layout (``policy``: a `ShardingPolicy` or a strategy, units then the
    ``_no_split_modules`` classes; ``units`` names them instead), ``mp_policy``, the optimizer's
    values per element, ``prefetch``, ``activation_bytes`` (one forward + loss on one rank's batch,
    without parameters), ``cp`` ([Note: context parallelism in the plan] in ``_plan/_planner.py``);
    with ``pp > 1`` the pipeline's settings ([Note: the memory of a pipeline stage] in
    ``_plan/_pipeline.py``; ``stage_bounds`` None: by parameter bytes; ``virtual_stages`` None: the
    schedule's; ``kept_grads`` None: `DEFAULT_KEPT_GRADS`, 0 without ``I``; ``tokens`` None: the
    head's and embedding's activations spread with the blocks).
    """

    policy: ShardingPolicy | ShardingStrategy | str = ShardingStrategy.FULL_SHARD
    units: Sequence[str] | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    optimizer_states: int = 2
    optimizer_dtype: torch.dtype | None = None
    prefetch: int = 2
    activation_bytes: int = 0
    cp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    stage_bounds: Sequence[int] | None = None
    virtual_stages: int | None = None
    reshard_between_microbatches: bool = False
    reduce_every_microbatch: bool = False
    kept_grads: float | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class MeshOptions:
    """What `suggest_mesh` searches with, besides the cluster: ``policy`` (None: the
    ``_no_split_modules`` units; its strategy is varied) and the planning fields as `PlanOptions`'s
    (``microbatches`` 8 here); ``headroom``: the share of ``bytes_per_gpu`` a plan may use; the
    bandwidths in bytes/s per GPU; ``pp_sizes``, ``cp_sizes``: the sizes to try."""

    policy: ShardingPolicy | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    activation_bytes: int = 0
    optimizer_states: int = 2
    headroom: float = 0.9
    intra_host_bandwidth: float = 200e9
    inter_host_bandwidth: float = 25e9
    pp_sizes: tuple[int, ...] = (1,)
    microbatches: int = 8
    schedule: str = "1f1b"
    cp_sizes: tuple[int, ...] = (1,)
    kept_grads: float | None = None
    tokens: int | None = None


O = TypeVar("O", PlanOptions, MeshOptions)


def with_overrides(options: O, overrides: dict[str, Any], caller: str) -> O:
    """``options`` with the keyword fields of a call replaced (a TypeError names unknown ones)."""
    unknown = sorted(set(overrides) - {f.name for f in fields(options)})
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}; the options are the fields of "
                        f"{type(options).__name__}")
    return replace(options, **overrides) if overrides else options
