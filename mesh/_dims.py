"""`ParallelDims`: the sizes of the parallelism axes (``pp`` optional), validated.

Pure arithmetic, no torch.distributed: safe to build and test anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ._ep_dims import check_ep, dp_shard_mod_ep

__all__ = ["AXIS_NAMES", "CP_AXIS", "PP_AXIS", "ParallelDims", "dp_axis_names"]

AXIS_NAMES: tuple[str, str, str] = ("dp_replicate", "dp_shard", "tp")
"""Mesh axis names, outermost first. ``tp`` is innermost (consecutive ranks)."""

PP_AXIS = "pp"
"""Name of the pipeline axis; outermost when present (``pp > 1``)."""

CP_AXIS = "cp"
"""Name of the context-parallel axis; between ``dp_shard`` and ``tp`` when present (``cp > 1``)."""


def dp_axis_names(dp_replicate: int) -> tuple[str, ...]:
    """The axes data-parallel sharding (``fully_shard``) spans: ``("dp_shard",)`` when ``dp_replicate
    == 1`` (plain FSDP), otherwise ``("dp_replicate", "dp_shard")`` (HSDP: replicate outer, shard
    inner). The one statement of that rule (`data_parallel_mesh`, `ParallelDims.dp_axis_names`)."""
    return ("dp_shard",) if dp_replicate == 1 else ("dp_replicate", "dp_shard")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the ``[pp x] dp_replicate`` x ``dp_shard`` [x ``cp``] x ``tp`` device mesh.

    All fields are keyword-only::

        ParallelDims(dp_replicate=2, tp=2, world_size=8)  # dp_shard resolves to 2

    Fields:
        dp_replicate: data-parallel replicas (the HSDP outer axis). Default 1.
        dp_shard: data-parallel ranks that shard parameters (FSDP). Default -1.
        tp: tensor-parallel ranks. Default 1.
        pp: pipeline stages, outermost. Default 1; a positive int, never -1.
        cp: context-parallel ranks, between ``dp_shard`` and ``tp``. Default 1; never -1.
        ep: expert-parallel degree (default 1). Adds no ranks: it must divide ``dp_shard``
            (times ``cp``); experts are sharded over ``ep`` and ``fully_shard``-ed over the
            remaining ``dp_shard_mod_ep`` ranks (docs/expert_parallel.md).
        world_size: total number of ranks. Required.

    Rules, checked in ``__post_init__`` (``ValueError`` with the arithmetic spelled out):
    ``world_size`` is a positive int; each of ``dp_replicate``, ``dp_shard``, ``tp`` is a
    positive int or -1, at most one -1, resolved to ``world_size // (product of the others)``,
    which must divide evenly (``ParallelDims(world_size=8).dp_shard == 8``);
    ``pp * dp_replicate * dp_shard * cp * tp == world_size``; ``bool`` is rejected.

    `axis_names` and `mesh_shape` follow torchtitan's order ``pp, dp_replicate, dp_shard, cp,
    tp``, with no ``pp`` entry when ``pp == 1`` and no ``cp`` entry when ``cp == 1``.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    world_size: int
    # expert parallelism: no ranks of its own, carved out of dp_shard (x cp); see mesh/_ep.py
    ep: int = 1

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size)
        if self.world_size < 1:
            raise ValueError(f"ParallelDims: world_size={self.world_size} is invalid; it must be a positive int (the "
                             "number of ranks)")
        sizes = {name: getattr(self, name) for name in AXIS_NAMES}
        for name, size in sizes.items():
            _check_int(name, size)
            if size < 1 and size != -1:
                raise ValueError(f"ParallelDims: {name}={size} is invalid; each size must be a positive int, or -1 "
                                 "for 'the rest of world_size'")
        _check_int("pp", self.pp)
        if self.pp < 1:
            raise ValueError(f"ParallelDims: pp={self.pp} is invalid; the number of pipeline stages must be a positive "
                             "int (-1 is not accepted for pp)")
        # -- cp (context parallelism): a fixed positive factor, like pp; see _cp_layout below
        _check_int("cp", self.cp)
        if self.cp < 1:
            raise ValueError(f"ParallelDims: cp={self.cp} is invalid; the number of context-parallel ranks must be "
                             "a positive int (-1 is not accepted for cp)")
        inferred = [name for name, size in sizes.items() if size == -1]
        if len(inferred) > 1:
            listed = " and ".join(f"{name}=-1" for name in inferred)
            raise ValueError(f"ParallelDims: {listed}: at most one size can be -1 (the rest of world_size); give the "
                             "others explicitly")
        if inferred:
            (name,) = inferred
            others = [n for n in AXIS_NAMES if n != name]
            known = prod(sizes[n] for n in others) * self.pp * self.cp
            if self.cp > 1:
                sizes["cp"] = self.cp
                others = [*others, "cp"]
            if self.pp > 1:
                sizes["pp"] = self.pp
                others = ["pp", *others]
            if self.world_size % known != 0:
                formula = " * ".join(f"{n}({sizes[n]})" for n in others)
                raise ValueError(f"{name}=-1 cannot be resolved: world_size({self.world_size}) is not divisible by "
                                 f"{formula} = {known}")
            sizes[name] = self.world_size // known
            object.__setattr__(self, name, sizes[name])
        sizes.pop("pp", None)
        sizes.pop("cp", None)
        total = prod(sizes.values()) * self.pp * self.cp
        if total != self.world_size:
            fields = (("pp",) if self.pp > 1 else ()) + AXIS_NAMES + (("cp",) if self.cp > 1 else ())
            sizes["pp"], sizes["cp"] = self.pp, self.cp
            formula = " * ".join(f"{n}({sizes[n]})" for n in fields)
            raise ValueError(f"{formula} = {total} != world_size({self.world_size}); choose sizes whose product is "
                             "world_size, or pass -1 for one of them to infer it")
        check_ep(self)  # expert parallelism (mesh/_ep_dims.py)

    @property
    def dp_shard_mod_ep(self) -> int:
        """The data-parallel ranks the experts are ``fully_shard``-ed over: ``dp_shard * cp / ep``."""
        return dp_shard_mod_ep(self)

    @property
    def dp_size(self) -> int:
        """Total data-parallel degree: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: ``dp_replicate * dp_shard * cp * tp``."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(dp_replicate, dp_shard, tp)``, with ``pp`` first when ``pp > 1``; in the order of `axis_names`."""
        inner = _cp_layout(self, (self.dp_replicate, self.dp_shard, self.tp), self.cp)
        return (self.pp, *inner) if self.pp > 1 else inner

    @property
    def axis_names(self) -> tuple[str, ...]:
        """``("dp_replicate", "dp_shard", "tp")``, size-1 axes included; with ``pp > 1`` ``("pp", ...)`` first."""
        inner = _cp_layout(self, AXIS_NAMES, CP_AXIS)
        return (PP_AXIS, *inner) if self.pp > 1 else inner

    @property
    def dp_axis_names(self) -> tuple[str, ...]:
        """Axes that ``fully_shard`` spans: `dp_axis_names` of ``dp_replicate`` (what `data_parallel_mesh` slices)."""
        return dp_axis_names(self.dp_replicate)


# -- context parallelism (issue 25): the cp axis sits between dp_shard and tp, torchtitan's order
# ("pp", "dp_replicate", "dp_shard", "cp", "tp"), and exists only when cp > 1 (a size-1 cp axis
# would change every existing mesh's shape); code that reads it asks mesh_axes(mesh).size("cp"),
# which is 1 for an absent axis.
def _cp_layout(dims: "ParallelDims", inner: tuple, cp_entry: object) -> tuple:
    """``inner`` (dp_replicate, dp_shard, tp entries) with ``cp_entry`` before tp when cp > 1."""
    return (*inner[:2], cp_entry, inner[2]) if dims.cp > 1 else tuple(inner)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ParallelDims: {name} must be an int, got {value!r} ({type(value).__name__})")
