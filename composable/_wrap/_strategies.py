"""The sharding strategies, as one table: name -> mesh rule, resharding, Accelerate's number.

[Note: the strategy table]
Every rule that depends on the strategy is read from its `StrategySpec` here: its data-parallel
mesh (``"shard"``: one axis of all ranks; ``"hybrid"``: replicas x shards; ``"replicate"``: a
shard axis of 1), whether units reshard after forward, and Accelerate's
``fsdp_sharding_strategy`` number. `strategy_mesh`, `apply_fully_shard`, the Accelerate reader
and the planner all ask the table, so a new strategy is one `StrategySpec` in `STRATEGIES` plus
its member in `ShardingStrategy`::

    StrategySpec("SHARD_GRADS", None, False, "shard", "ZeRO-2"),   # in STRATEGIES
    SHARD_GRADS = "SHARD_GRADS"                                     # in ShardingStrategy
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["StrategySpec", "STRATEGIES", "ShardingStrategy"]


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: ``mesh`` is ``"shard"``, ``"hybrid"`` or ``"replicate"`` (see the note);
    ``accelerate`` its ``fsdp_sharding_strategy`` number (None: Accelerate has none); ``zero``
    what DeepSpeed calls it, for messages and docs."""

    name: str
    accelerate: int | None
    reshard_after_forward: bool
    mesh: str
    zero: str

    def __post_init__(self) -> None:
        if self.mesh not in ("shard", "hybrid", "replicate"):
            raise ValueError(f"StrategySpec {self.name}: mesh={self.mesh!r}; use 'shard', 'hybrid' or 'replicate'")

    def mesh_problem(self, replicas: int, shards: int) -> str | None:
        """Why a data-parallel mesh of ``replicas x shards`` ranks does not suit this strategy
        (None: it does), naming the mesh or strategy to use instead."""
        other = _peer(self)
        if self.mesh == "hybrid" and replicas == 1:
            return (f"{self.name} replicates over the outer axis and shards over the inner one, but the mesh has 1 "
                    f"replica x {shards} shards. Pass a mesh with replicas (dp_replicate > 1): init_mesh(dp_replicate=R, dp_shard=S) "
                    f"with R > 1 and R * S = {shards}, or use {other}")
        if self.mesh == "shard" and replicas > 1:
            return (f"{self.name} shards over one axis but the mesh has {replicas} replicas x {shards} shards. Use "
                    f"{other} to shard within the replicas, or build init_mesh(dp_replicate=1, "
                    f"dp_shard={replicas * shards}) to shard over all ranks")
        return None


def _peer(spec: StrategySpec) -> str:
    """The strategy with the same resharding on the other kind of mesh (for messages)."""
    want = "shard" if spec.mesh == "hybrid" else "hybrid"
    for s in STRATEGIES.values():
        if s.mesh == want and s.reshard_after_forward == spec.reshard_after_forward:
            return s.name
    return "another strategy"


STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("FULL_SHARD", 1, True, "shard", "ZeRO-3"),
    StrategySpec("SHARD_GRAD_OP", 2, False, "shard", "ZeRO-2"),
    StrategySpec("NO_SHARD", 3, False, "replicate", "DDP"),
    StrategySpec("HYBRID_SHARD", 4, True, "hybrid", "ZeRO-3 within a replica (hpZ: ZeRO++)"),
    StrategySpec("HYBRID_SHARD_ZERO2", 5, False, "hybrid", "ZeRO-2 within a replica"),
)}


class ShardingStrategy(str, enum.Enum):
    """Accelerate's (and FSDP1's) strategy names; what each means is its `StrategySpec` in
    `STRATEGIES` ([Note: the strategy table]).

    * ``FULL_SHARD`` (ZeRO-3): 1-D mesh, shard over all D ranks; reshard_after_forward True.
    * ``SHARD_GRAD_OP`` (ZeRO-2): 1-D mesh, shard over all D ranks; False.
    * ``NO_SHARD`` (DDP-like): 2-D ``(D, 1)`` mesh, replicate over all, shard size 1; False.
    * ``HYBRID_SHARD``: 2-D ``(R, S)`` mesh with ``R > 1``, shard within a replica; True.
    * ``HYBRID_SHARD_ZERO2``: 2-D ``(R, S)`` mesh with ``R > 1``; False.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @property
    def spec(self) -> StrategySpec:
        return STRATEGIES[self.value]

    @property
    def reshard_after_forward(self) -> bool:
        return self.spec.reshard_after_forward

    @property
    def is_hybrid(self) -> bool:
        return self.spec.mesh == "hybrid"

    @property
    def replicates_all(self) -> bool:
        """Every rank a replica, shard axis of one (NO_SHARD)."""
        return self.spec.mesh == "replicate"

    @classmethod
    def parse(cls, value: "ShardingStrategy | str | int") -> "ShardingStrategy":
        """A strategy from itself, its name in any case (``"ShardingStrategy.X"`` too), or
        Accelerate's number."""
        key = value.value if isinstance(value, cls) else str(value).strip().upper().rpartition(".")[2]
        numbers = {s.accelerate: name for name, s in STRATEGIES.items() if s.accelerate is not None}
        if key.isdigit() and int(key) in numbers:
            return cls(numbers[int(key)])
        if key in cls.__members__:
            return cls[key]
        raise ValueError(f"unknown sharding strategy {value!r}; use one of {[s.value for s in cls]} "
                         f"(or Accelerate's numbers {sorted(numbers)})")


def _check_table() -> None:
    names = {m.value for m in ShardingStrategy}
    if names != set(STRATEGIES):
        raise AssertionError(f"ShardingStrategy members {sorted(names)} and STRATEGIES {sorted(STRATEGIES)} differ")


_check_table()
