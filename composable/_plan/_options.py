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
    """What `plan_memory` plans a model's layout with, besides the mesh shape.

    Layout: ``policy`` (a `ShardingPolicy`, or a strategy: units are then the
    ``_no_split_modules`` classes; none: the root only), ``units`` (module names instead),
    ``mp_policy`` (``param_dtype`` sizes gathered parameters and their gradients,
    ``reduce_dtype`` the reduce-scatter input), ``optimizer_states`` and ``optimizer_dtype``
    (values per trainable element, AdamW: 2; None: the parameter's dtype, as ``torch.optim``),
    ``prefetch`` (units gathered at once when resharding, ``set_unshard_limit``),
    ``activation_bytes`` (one forward + loss on one rank's batch, without parameters), ``cp``
    (context-parallel ranks: [Note: context parallelism in the plan] in ``_plan/_planner.py``).

    Pipeline, with ``pp > 1`` (``mesh_shape`` is then one stage's; see [Note: the memory of a
    pipeline stage] in ``_plan/_pipeline.py``): ``microbatches``, ``schedule`` (a registered
    name), ``stage_bounds`` (the blocks' split points; None: by parameter bytes),
    ``virtual_stages`` (stages per rank; None: 2 for a schedule with virtual stages, else 1),
    ``reshard_between_microbatches`` and ``reduce_every_microbatch`` (as `PipelineSchedule`'s),
    ``kept_grads`` (for a split backward: gradients kept from ``I`` to ``W`` per microbatch-unit
    of activations; None: `DEFAULT_KEPT_GRADS`, or 0 without ``I``), ``tokens`` (per
    data-parallel rank per step, that ``activation_bytes`` was measured on: places the head's and
    the embedding's activations on their stages; None: spread with the blocks).
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
    """What `suggest_mesh` searches with, besides the cluster. ``policy`` (None: units are the
    ``_no_split_modules`` classes; its strategy is varied), ``mp_policy``, ``activation_bytes``
    (per rank at tp 1), ``optimizer_states``, ``microbatches``, ``schedule``, ``kept_grads``,
    ``tokens``: as `PlanOptions`'s (``microbatches`` defaults to 8 here); ``headroom``: the
    fraction of ``bytes_per_gpu`` a plan may use; ``intra_host_bandwidth``,
    ``inter_host_bandwidth``: bytes/s per GPU; ``pp_sizes``, ``cp_sizes``: the pipeline and
    context-parallel sizes to try."""

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
