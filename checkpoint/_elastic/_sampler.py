"""`ElasticSampler`: a data position that survives a change of the data-parallel size.

    sampler = ElasticSampler(dataset, global_batch=32, mesh=mesh, seed=0)      # or dp_rank=, dp_size=
    ts = load_training_state(path, model, optim, data=sampler)                 # at any dp size

[Note: one global order, cut into global batches]
An epoch's order depends only on ``seed + epoch`` (``torch.randperm(n)`` as ``DistributedSampler``
draws it; the identity with ``shuffle=False``), cut into *global batches* of ``B`` positions. Rank
``r`` of ``W`` reads ``[k B + r b, k B + (r + 1) b)`` of batch ``k`` (``b = B / W``) as
``accumulation`` micro-batches. So every global batch is the same samples at every size, the
position is ``(epoch, consumed)`` with ``consumed`` a multiple of ``B``, and resuming at another
size reads exactly what an uninterrupted run would have. The tail is padded to ``B`` (not to the
world size): ``drop_last=True`` drops ``n mod B`` samples, ``False`` repeats the order's first.

With ``mesh=`` the coordinate is the row-major index on ``dp_replicate`` x ``dp_shard`` (or a
``dp`` axis; every axis of an unnamed mesh), so ``tp`` / ``pp`` / ``cp`` peers read the same
samples. A micro-batch handed out counts as consumed (`ElasticLoader` counts only delivered ones);
a position inside a global batch loads only at the same size and micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler

__all__ = ["BatchPlan", "ElasticSampler", "plan_batches", "epoch_order", "epoch_length", "rank_positions"]


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch splits at one data-parallel size: ``global_batch = dp_size *
    micro_batch * accumulation``; each rank reads ``per_rank = micro_batch * accumulation``."""

    global_batch: int
    dp_size: int
    micro_batch: int
    accumulation: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation


def plan_batches(global_batch: int, dp_size: int, micro_batch: int | None = None) -> BatchPlan:
    """The `BatchPlan` that keeps ``global_batch`` at ``dp_size`` ranks: without ``micro_batch``
    each rank reads ``global_batch / dp_size`` at once (accumulation 1); with it, the accumulation
    steps are recomputed. ``ValueError`` (naming the numbers and the fix) when it cannot be kept."""
    for name, v in (("global_batch", global_batch), ("dp_size", dp_size), ("micro_batch", micro_batch)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if global_batch % dp_size:
        raise ValueError(f"the global batch {global_batch} cannot be kept at data-parallel size {dp_size}: it is not "
                         f"a multiple of {dp_size}; run at a data-parallel size that divides {global_batch}, or "
                         "choose a global batch that is a multiple of every size the job may run at")
    per_rank = global_batch // dp_size
    if micro_batch is None:
        return BatchPlan(global_batch, dp_size, per_rank, 1)
    if per_rank % micro_batch:
        raise ValueError(f"the global batch {global_batch} cannot be kept at data-parallel size {dp_size} with "
                         f"micro_batch {micro_batch}: each rank reads {per_rank} samples, not a multiple of "
                         f"{micro_batch}; choose a micro_batch that divides {per_rank} (or micro_batch=None)")
    return BatchPlan(global_batch, dp_size, micro_batch, per_rank // micro_batch)


def epoch_length(num_samples: int, global_batch: int, drop_last: bool) -> int:
    """Positions in one epoch: ``num_samples`` rounded down (``drop_last``) or up to a multiple
    of ``global_batch`` (see [Note: one global order, cut into global batches])."""
    full, rest = divmod(num_samples, global_batch)
    return (full + (rest > 0 and not drop_last)) * global_batch


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of the dataset's indices: independent of any world size."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def rank_positions(plan: BatchPlan, dp_rank: int, batch: int, micro: int) -> range:
    """The epoch positions of micro-batch ``micro`` of global batch ``batch`` on ``dp_rank``
    (positions at or past ``num_samples`` wrap to the start of the order)."""
    start = batch * plan.global_batch + dp_rank * plan.per_rank + micro * plan.micro_batch
    return range(start, start + plan.micro_batch)


def _dp_coordinate(mesh: Any) -> tuple[int, int]:
    from shardwise.mesh import mesh_axes

    axes = mesh_axes(mesh, caller="ElasticSampler")
    dims = [n for n in ("dp_replicate", "dp_shard", "dp") if axes.has(n)]
    if axes.names and not dims:
        raise ValueError(f"ElasticSampler: the mesh has axes {axes.names} and none of them is data-parallel "
                         "('dp_replicate', 'dp_shard' or 'dp'); pass the data-parallel mesh, or dp_rank= and dp_size=")
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"ElasticSampler: this rank is not in the mesh {mesh.mesh.tolist()}")
    where = [axes.index(n) for n in dims] if axes.names else list(range(mesh.ndim))
    rank, size = 0, 1
    for i in where:
        rank, size = rank * mesh.size(i) + coord[i], size * mesh.size(i)
    return rank, size


class ElasticSampler(Sampler[list[int]]):
    """A batch sampler (``DataLoader(ds, batch_sampler=s)``) of this data-parallel rank's
    micro-batches (lists of indices) whose `state_dict` loads at any data-parallel size.

    ``data``: a sized dataset, an iterable one with ``__len__`` (``shuffle=False``), or a count.
    ``global_batch``: samples per optimizer step over all ranks. The rank comes from ``mesh`` or
    ``dp_rank`` / ``dp_size``. ``micro_batch``: samples per rank per forward. ``shuffle``,
    ``seed``, ``drop_last`` as ``DistributedSampler``'s ([Note: one global order, cut into global
    batches]). `set_epoch` with another epoch starts it; with the current one keeps the position."""

    def __init__(self, data: Sized | int, global_batch: int, *, mesh: Any = None, dp_rank: int | None = None,
                 dp_size: int | None = None, micro_batch: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        n = data if isinstance(data, int) and not isinstance(data, bool) else len(data)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError(f"ElasticSampler: the dataset has {n} samples; it needs at least one")
        if isinstance(data, IterableDataset) and shuffle:
            raise ValueError("ElasticSampler: an iterable dataset is read in its own order; pass shuffle=False "
                             "(or give a map-style dataset to shuffle)")
        if mesh is not None and (dp_rank is not None or dp_size is not None):
            raise ValueError("ElasticSampler: pass mesh= or dp_rank=/dp_size=, not both")
        if mesh is not None:
            dp_rank, dp_size = _dp_coordinate(mesh)
        dp_rank, dp_size = (0 if dp_rank is None else dp_rank), (1 if dp_size is None else dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"ElasticSampler: dp_rank {dp_rank} must be in [0, dp_size {dp_size})")
        self.num_samples, self.shuffle, self.seed, self.drop_last = n, bool(shuffle), int(seed), bool(drop_last)
        self.plan = plan_batches(global_batch, dp_size, micro_batch)
        if self.drop_last and n < global_batch:
            raise ValueError(f"ElasticSampler: {n} samples make no full global batch of {global_batch} with "
                             "drop_last=True, so every epoch would be empty; use drop_last=False or a smaller batch")
        self._micro_batch_arg = micro_batch
        self.dp_rank = dp_rank
        self.epoch = 0
        self.consumed = 0  # positions of the epoch in finished global batches (a multiple of global_batch)
        self.micro_step = 0  # micro-batches of the next global batch already handed out
        self.samples_seen = 0  # global samples (padding included) handed out since the start of training
        self._order: tuple[int, list[int]] | None = None

    # -- arithmetic ------------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def batches_per_epoch(self) -> int:
        """Global batches (optimizer steps) in one epoch."""
        return epoch_length(self.num_samples, self.global_batch, self.drop_last) // self.global_batch

    def order(self) -> list[int]:
        """The current epoch's order of dataset indices (cached per epoch)."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle))
        return self._order[1]

    def _remaining(self) -> Iterator[tuple[int, int]]:
        """``(batch, micro)`` of every micro-batch left in this epoch, from the position."""
        first = self.consumed // self.global_batch
        for k in range(first, self.batches_per_epoch):
            for j in range(self.micro_step if k == first else 0, self.plan.accumulation):
                yield k, j

    def positions(self) -> Iterator[range]:
        """This rank's remaining micro-batches of the epoch as epoch positions; moves nothing."""
        for k, j in self._remaining():
            yield rank_positions(self.plan, self.dp_rank, k, j)

    def indices(self) -> Iterator[list[int]]:
        """This rank's remaining micro-batches of the epoch as dataset indices; moves nothing."""
        order, n = self.order(), self.num_samples
        for pos in self.positions():
            yield [order[p % n] for p in pos]

    def advance(self) -> None:
        """Count one micro-batch (one per rank, all ranks alike) as consumed; after the last one
        of the epoch the position is the start of the next epoch."""
        if self.consumed >= self.batches_per_epoch * self.global_batch:
            raise RuntimeError("ElasticSampler.advance: the epoch has no micro-batch left")
        self.micro_step += 1
        self.samples_seen += self.plan.micro_batch * self.plan.dp_size
        if self.micro_step == self.plan.accumulation:
            self.micro_step, self.consumed = 0, self.consumed + self.global_batch
        if self.consumed == self.batches_per_epoch * self.global_batch:
            self.epoch, self.consumed = self.epoch + 1, 0

    # -- the Sampler protocol --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.indices():
            self.advance()
            yield batch

    def __len__(self) -> int:
        """Micro-batches this rank has left in the epoch."""
        return sum(1 for _ in self._remaining())

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; the current epoch keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self.micro_step = int(epoch), 0, 0

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position (JSON): the same on every rank; loads at any data-parallel size."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "micro_step": self.micro_step,
                "samples_seen": self.samples_seen, "global_batch": self.global_batch,
                "num_samples": self.num_samples, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dp_size": self.plan.dp_size, "micro_batch": self.plan.micro_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`, at any data-parallel size). The dataset
        size, global batch, ``shuffle`` and ``drop_last`` must be those of the saved run (else
        the order differs: ``ValueError`` naming the field); the seed and position are taken."""
        need = ("seed", "epoch", "consumed", "micro_step", "global_batch", "num_samples", "shuffle", "drop_last")
        missing = [k for k in need if k not in state]
        if missing:
            raise ValueError(f"ElasticSampler.load_state_dict: not a sampler state (missing {missing})")
        for key, mine in (("num_samples", self.num_samples), ("global_batch", self.global_batch),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last)):
            if state[key] != mine:
                raise ValueError(f"ElasticSampler.load_state_dict: the saved run had {key}={state[key]!r}, this "
                                 f"sampler has {mine!r}; build the sampler with {key}={state[key]!r} to resume the "
                                 "same sample order")
        if state["micro_step"] and (state.get("dp_size"), state.get("micro_batch")) != (self.plan.dp_size,
                                                                                        self.plan.micro_batch):
            raise ValueError(
                f"ElasticSampler.load_state_dict: the state was saved inside a global batch ({state['micro_step']} "
                f"micro-batches of {state.get('micro_batch')} handed out at data-parallel size {state.get('dp_size')}),"
                f" which resumes only at that size and micro-batch (here {self.plan.dp_size}, "
                f"{self.plan.micro_batch}); save at a step boundary to resume at any size")
        if state["consumed"] % self.global_batch or not 0 <= state["consumed"] < max(
                self.batches_per_epoch * self.global_batch, 1):
            raise ValueError(f"ElasticSampler.load_state_dict: consumed={state['consumed']} is not a position of "
                             "this epoch's global batches")
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self.consumed, self.micro_step = int(state["consumed"]), int(state["micro_step"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self._order = None
