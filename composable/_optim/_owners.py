"""Which rank of a shard axis owns which whole tensor: a plan every rank computes alike.

[Note: owners of whole matrices]
An optimizer needing whole matrices (Muon's Newton-Schulz, Shampoo) cannot update a row slice.
Each matrix gets one *owner* on its shard axis, ZeRO-1 style: it receives the rows, runs the
optimizer on the whole matrix, sends the new rows back, and alone keeps its state. The plan is a
pure function of the sizes (in parameter order) and the axis size, so no collective: largest
matrices first, each to the rank with the least work so far (ties: the lower rank). Work counts
elements, which for Muon (``m n min(m, n)`` multiply-adds) balances transformer shapes sharing
their short side; a world of one owns everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["OwnerPlan", "plan_owners"]


@dataclass(frozen=True)
class OwnerPlan:
    """``owners[i]``: the shard-axis rank that owns tensor ``i``; ``loads[r]``: the elements
    rank ``r`` owns (the balance the plan reached)."""

    owners: tuple[int, ...]
    loads: tuple[int, ...]

    def owned_by(self, rank: int) -> list[int]:
        """The indices of the tensors ``rank`` owns, in parameter order."""
        return [i for i, o in enumerate(self.owners) if o == rank]


def plan_owners(sizes: Sequence[int], world: int) -> OwnerPlan:
    """Owners for tensors of ``sizes`` elements over ``world`` ranks ([Note: owners of whole
    matrices]): largest first, each to the least loaded rank."""
    if world < 1:
        raise ValueError(f"plan_owners: world must be >= 1, got {world}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"plan_owners: sizes must be >= 0, got {list(sizes)}")
    loads = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += sizes[i]
    return OwnerPlan(tuple(owners), tuple(loads))
