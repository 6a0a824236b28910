"""The gradient-reduction pipeline of one unit: reduce-scatter, average, replica all-reduce, store.

[Note: the reduction pipeline]
After a unit's backward, ``reduce_grads`` casts each unsharded gradient into its column block of
a rank-major ``[W, S]`` send buffer, one per *bucket* (the trainable parameters of one reduce
dtype), frees the unsharded gradients and issues one asynchronous reduce-scatter per bucket.
Each is a ``PendingReduce`` moving through stages:

    SCATTER    the reduce-scatter is in flight
      |          wait, divide by R * W (the mean over the global batch)
      |-> DONE        1-D mesh, or HSDP accumulation (``requires_all_reduce=False``): the sum
      |               over the shard axis is added to the sharded ``.grad``
      '-> ALL_REDUCE  2-D mesh: the all-reduce over the replicate axis is issued, in flight
            |-> DONE  wait, add to the sharded ``.grad``

Issuing one unit's reductions advances the earlier ones a stage; the end-of-backward callback
finishes the rest (``_root.py``). After HSDP accumulation the bucket holds replica-partial sums
(``partial_over_replicas``), all-reduced once by the next reduction with the all-reduce.

[Note: unused parameters]
A parameter that got no gradient in a backward must keep ``.grad`` None, as on one device, or
weight decay and moments move it. Ranks may disagree (data-dependent control flow) and must run
the same collective, so every rank sends every column block (zeros where it has no gradient)
plus, per parameter, one *used* flag column (1 where this rank had a gradient). The flags travel
in the same reduce-scatter (and replica all-reduce), so every rank gets the same count of users
at no extra collective. A parameter whose ``.grad`` was None and whose count is 0 gets ``.grad =
None`` back at the end of the backward (``resolve_unused``; earlier would stall the host). A rank
reads counts only for parameters it had no gradient for (``used_here``), so the usual step has no
host read. Under HSDP accumulation the counts are summed over micro-batches (``Bucket.seen``).
``set_reduce_scatter_unused_params(True)`` (as FSDP2) sets every flag: zero gradients instead.

[Note: dividing and the reduction hook]
The collectives always sum (gloo has no average for every dtype; a sum keeps the flags exact);
then the gradients are divided by ``R * W``, or by ``set_gradient_divide_factor(f)``. A hook set
with ``set_all_reduce_hook`` runs in place on a bucket's reduced gradient elements (not flags):
after the reduce-scatter on a 1-D mesh, after the replica all-reduce on a 2-D one, as FSDP2. It
sees them divided, or, with ``set_force_sum_reduction_for_comms(True)``, as sums divided after
it; so a hook averaging over another group (torchft's replicas) gives the mean over both.
Backwards that only accumulate call no hook; the HSDP all-reduce that finishes an accumulation
calls it on the accumulated (divided) shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ._comm import reduce_scatter, send_buffer
from .._mesh_utils import reduce_scatter_single
from ._sharded_param import ShardedParam

__all__ = ["ReduceStage", "PendingReduce", "make_buckets", "reduce_grads", "resolve_unused"]


class ReducingUnit(Protocol):
    """What the reduction needs of a unit (a ``ParamGroup``): its buckets, axes and names."""

    label: str
    world: int
    rank: int
    replicate_world: int
    replicate_group: Any
    shard_group: Any
    compute_device: torch.device
    trace: Any
    buckets: list["Bucket"]
    reduce_scatter_unused_params: bool
    comm: Any  # CommOptions: what the FSDPModule setters change about the collectives


class ReduceStage(Enum):
    SCATTER = "scatter"
    ALL_REDUCE = "all_reduce"
    DONE = "done"


_NEXT = {
    ReduceStage.SCATTER: (ReduceStage.ALL_REDUCE, ReduceStage.DONE),
    ReduceStage.ALL_REDUCE: (ReduceStage.DONE,),
    ReduceStage.DONE: (),
}


@dataclass
class Bucket:
    """Trainable parameters reduced together in one ``dtype`` reduce-scatter; parameter ``i``
    is elements ``[offsets[i], offsets[i] + padded_numel_i)`` of each rank's row, and its used
    flag is element ``numel + i`` ([Note: unused parameters]); a row is ``row`` elements."""

    dtype: torch.dtype
    params: list
    offsets: list[int]
    numel: int
    partial_over_replicas: bool = False  # holds reduce-scattered but not yet all-reduced sums
    # [Note: unused parameters]: used-flag counts summed since the last resolution, and the
    # indices of parameters whose sharded .grad the reductions since then created
    seen: torch.Tensor | None = None
    fresh: set[int] = field(default_factory=set)
    used_here: set[int] = field(default_factory=set)  # indices this rank sent a 1 for

    @property
    def row(self) -> int:
        return self.numel + len(self.params)


def make_buckets(params: list[ShardedParam], reduce_dtype: torch.dtype | None) -> list[Bucket]:
    """One bucket per reduce dtype (``reduce_dtype``, else each parameter's compute dtype) over
    the parameters that require grad, in parameter order."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        if p.requires_grad:
            by_dtype.setdefault(reduce_dtype or p.compute_dtype, []).append(p)
    buckets = []
    for dtype, ps in by_dtype.items():
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += p.layout.padded_numel
        buckets.append(Bucket(dtype, ps, offsets, total))
    return buckets


@dataclass
class PendingReduce:
    """One bucket's issued reduction of one unit (``group``, a ``ParamGroup``); see
    [Note: the reduction pipeline]. ``work`` is the collective in flight (None: none)."""

    group: ReducingUnit
    bucket: Bucket
    work: Any  # a c10d Work, or None
    out: torch.Tensor
    all_reduce: bool
    stage: ReduceStage = field(default=ReduceStage.SCATTER)
    # once DONE with final (not replica-partial) values: (bucket, used counts, fresh indices)
    unused_check: tuple | None = None
    bucketed: bool = False  # its all-reduce is a replica bucket's ([Note: replica buckets] in _bucket.py)
    divided: bool = False  # ALL_REDUCE: divided before the all-reduce was issued

    def issued_all_reduce(self, work: dist.Work | None) -> None:
        """Its replica bucket's all-reduce ``work`` was issued (nothing divided yet)."""
        self.work = work
        self._to(ReduceStage.ALL_REDUCE)

    def _to(self, stage: ReduceStage) -> None:
        if stage not in _NEXT[self.stage]:
            raise AssertionError(f"fully_shard({self.group.label}): reduction stage {self.stage.name} -> {stage.name}")
        self.stage = stage

    def advance(self) -> bool:
        """Move one stage on; True once the result is stored in the sharded ``.grad`` (DONE).
        [Note: dividing and the reduction hook]"""
        if self.work is not None:
            self.work.wait()
            self.work = None
        g, out, b = self.group, self.out, self.bucket
        opts = g.comm
        divisor = opts.gradient_divide_factor or g.world * g.replicate_world
        with torch.no_grad():
            if self.stage is ReduceStage.ALL_REDUCE:
                _hook_and_divide(opts, out, b, None if self.divided else divisor)
                _store(g, b, out)
                self._final(b)
                self._to(ReduceStage.DONE)
                return True
            if g.replicate_group is None:
                _hook_and_divide(opts, out, b, divisor)
                _store(g, b, out)
                self._final(b)
            elif not self.all_reduce:  # HSDP accumulation: keep the replica-partial sum
                out.div_(divisor)
                _store(g, b, out)
                b.partial_over_replicas = True
            elif not b.partial_over_replicas:
                if not opts.force_sum:
                    out.div_(divisor)
                    self.divided = True
                with record_function(g.trace.all_reduce):
                    self.work = dist.all_reduce(out, group=g.replicate_group, async_op=True)
                self._to(ReduceStage.ALL_REDUCE)
                return False
            else:  # last micro-batch: add it, then all-reduce the accumulated shards once
                out.div_(divisor)
                _store(g, b, out)
                _all_reduce_sharded_grads(g, b)
                b.partial_over_replicas = False
                self._final(b)
        self._to(ReduceStage.DONE)
        return True

    def _final(self, b: Bucket) -> None:
        """The bucket's gradients are final: keep its used counts for ``resolve_unused``."""
        self.unused_check = (b, b.seen, b.fresh - b.used_here)  # only these can have a count of 0
        b.seen, b.fresh, b.used_here = None, set(), set()

    def finish(self) -> None:
        """Run to completion."""
        while not self.advance():
            pass


def reduce_grads(g: ReducingUnit, *, all_reduce: bool, replica_buckets: Any = None) -> list[PendingReduce]:
    """Issue the reduce-scatter of the unsharded gradients of ``g`` (a ``ParamGroup``; one per
    bucket, async) and free them; frozen parameters never have one. On a 1-rank shard axis
    with ``replica_buckets`` (the root's ``ReplicaBuckets``) the gradients go into a replica
    bucket shared with other units instead ([Note: replica buckets] in ``_bucket.py``)."""
    W = g.world
    pending = []
    with torch.no_grad(), record_function(g.trace.reduce_scatter):
        for b in g.buckets:
            shared = replica_buckets is not None and replica_buckets.takes(g, b, all_reduce)
            if shared:
                send = replica_buckets.reserve(g, b)
            else:
                send = send_buffer(g.comm, W * b.row, b.dtype, g.compute_device)
            rows = send.view(W, b.row)
            used = []  # [Note: unused parameters]
            for i, (p, o) in enumerate(zip(b.params, b.offsets)):
                block = rows[:, o : o + p.layout.padded_numel]
                grad = p.take_unsharded_grad(b.dtype)
                used.append(grad is not None or g.reduce_scatter_unused_params)
                if used[-1]:
                    b.used_here.add(i)
                if grad is None:
                    block.zero_()
                else:
                    p.layout.scatter(grad, block, 0, W)
            rows[:, b.numel :].copy_(torch.tensor(used, dtype=b.dtype).expand(W, -1))
            if W == 1:  # nothing to scatter: the sum over one rank is the input
                pending.append(PendingReduce(g, b, None, send, all_reduce))
                if shared:
                    replica_buckets.add(pending[-1])
                continue
            work, out = reduce_scatter(g.comm, send, b.row, g.shard_group, reduce_scatter_single)
            pending.append(PendingReduce(g, b, work, out, all_reduce))
    return pending


def _hook_and_divide(opts: Any, out: torch.Tensor, b: Bucket, divisor: float | None) -> None:
    """The reduced gradients of ``b`` in ``out``: divided by ``divisor`` (None: already divided)
    before the user's reduction hook, or after it with ``force_sum``."""
    if divisor is not None and not opts.force_sum:
        out.div_(divisor)
    if opts.all_reduce_hook is not None:
        opts.all_reduce_hook(out[: b.numel])
    if divisor is not None and opts.force_sum:
        out.div_(divisor)


def _store(g: ReducingUnit, b: Bucket, out: torch.Tensor) -> None:
    for i, (p, o) in enumerate(zip(b.params, b.offsets)):
        if p.sharded.grad is None:
            b.fresh.add(i)
        p.accumulate_sharded_grad(out[o : o + p.layout.padded_numel])
    counts = out[b.numel : b.row]
    b.seen = counts.clone() if b.seen is None else b.seen.add_(counts)


def _all_reduce_sharded_grads(g: ReducingUnit, b: Bucket) -> None:
    locals_ = [p.sharded.grad.to_local() for p in b.params]
    assert b.seen is not None, "_store ran first"
    parts = [t.reshape(-1).to(b.dtype) for t in locals_] + [b.seen]
    flat = torch.cat(parts).to(g.compute_device)
    with record_function(g.trace.all_reduce):
        dist.all_reduce(flat, group=g.replicate_group)
    if g.comm.all_reduce_hook is not None:
        g.comm.all_reduce_hook(flat[: flat.numel() - b.seen.numel()])
    *chunks, seen = flat.split([t.numel() for t in parts])
    for t, chunk in zip(locals_, chunks):
        t.copy_(chunk.view_as(t))
    b.seen = seen


def resolve_unused(done: list[PendingReduce]) -> None:
    """After a backward's reductions are finished: ``.grad = None`` again for each parameter
    whose sharded gradient they created though no rank had a gradient for it ([Note: unused
    parameters]). One host read of all the counts together."""
    checks = [pr.unused_check for pr in done if pr.unused_check is not None and pr.unused_check[2]]
    if not checks:
        return
    counts = torch.cat([seen for _, seen, _ in checks]).tolist()
    at = 0
    for b, seen, fresh in checks:
        for i in fresh:
            if counts[at + i] == 0:
                b.params[i].sharded.grad = None
        at += seen.numel()
