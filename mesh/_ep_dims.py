"""The expert-parallel size rule of `ParallelDims`: pure arithmetic, no torch.distributed.

``ep`` adds no ranks: the ``dp_shard * cp`` ranks that shard data-parallel state are regrouped
as ``dp_shard_mod_ep x ep`` (``ep`` inner). Expert weights are split over ``ep`` and
``fully_shard``-ed over ``dp_shard_mod_ep``; dense weights keep the whole data-parallel extent
([Note: the expert mesh] in ``_ep.py``; docs/expert_parallel.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_ep", "ep_shard_extent", "dp_shard_mod_ep"]


def ep_shard_extent(dims: Any) -> int:
    """``dp_shard * cp`` of ``dims`` (``cp`` taken as 1 when absent): the ranks ``ep`` divides."""
    return int(dims.dp_shard) * int(getattr(dims, "cp", 1))


def dp_shard_mod_ep(dims: Any) -> int:
    """The data-parallel ranks left to the experts' ``fully_shard``: ``dp_shard * cp / ep``."""
    return ep_shard_extent(dims) // int(getattr(dims, "ep", 1))


def check_ep(dims: Any) -> None:
    """``ValueError`` (``TypeError`` for a non-int) unless ``dims.ep`` is a positive int dividing
    ``dp_shard * cp``; the message spells the arithmetic out."""
    ep = getattr(dims, "ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int):
        raise TypeError(f"ParallelDims: ep must be an int, got {ep!r} ({type(ep).__name__})")
    if ep < 1:
        raise ValueError(f"ParallelDims: ep={ep} is invalid; the expert-parallel degree must be a positive int "
                         "(1: no expert parallelism; -1 is not accepted for ep)")
    cp = int(getattr(dims, "cp", 1))
    extent = ep_shard_extent(dims)
    if extent % ep != 0:
        formula = f"dp_shard({dims.dp_shard})" + (f" * cp({cp})" if hasattr(dims, "cp") else "")
        raise ValueError(
            f"ParallelDims: ep({ep}) must divide {formula} = {extent} (expert parallelism adds no ranks: "
            f"it splits the data-parallel shard ranks into dp_shard_mod_ep x ep); {extent} % {ep} = "
            f"{extent % ep}: choose an ep that divides {extent}, or a dp_shard that ep divides")
