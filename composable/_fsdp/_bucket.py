"""Replica all-reduces bucketed across units: NO_SHARD (a shard axis of one rank), DDP's way.

[Note: replica buckets]
On a ``(D, 1)`` mesh (NO_SHARD, the DDP strategy) a unit's whole reduction is one all-reduce over
the replicas. Rather than one small collective per unit, the root's ``ReplicaBuckets`` packs the
gradients of consecutive units (in backward order) into one flat buffer and all-reduces it once
it holds ``FIRST_BUCKET_BYTES`` (small, so communication starts early, as DDP's first bucket) or
``BUCKET_BYTES`` (DDP's 25 MiB) after that; the end of backward flushes the last. A unit is never
split between buckets. Each unit's ``PendingReduce`` views its bucket; division, hook and store
stay per unit (``_reduce.py``), and the used flags of [Note: unused parameters] ride along.

Buffers are kept from step to step (bucket ``k`` reuses the previous bucket ``k``'s buffer; new
20 MiB buffers every step cost more in page faults than the copy). The ``.grad`` tensors view the
buffer, so it is reused only when nothing else still uses its storage (``zero_grad()`` dropped
them); otherwise a new buffer is allocated and the old one left to its users.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .._compat import storage_shared
from ._reduce import Bucket, PendingReduce, ReducingUnit

__all__ = ["ReplicaBuckets", "FIRST_BUCKET_BYTES", "BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass
class _Open:
    """The bucket being filled: ``key`` = (dtype, replica group, device); ``used`` elements."""

    key: tuple[torch.dtype, object, torch.device]
    buffer: torch.Tensor
    limit: int  # elements after which it is issued
    used: int = 0
    members: list[PendingReduce] = field(default_factory=list)  # in order


class ReplicaBuckets:
    """The replica all-reduce buckets of one root ([Note: replica buckets])."""

    def __init__(self) -> None:
        self._open: _Open | None = None
        self._index = 0  # bucket index within this backward
        self._buffers: dict[int, torch.Tensor] = {}  # index -> buffer kept from the last backward
        self._sizes: dict[int, int] = {}  # index -> elements it held last time

    @staticmethod
    def takes(g: ReducingUnit, bucket: Bucket, all_reduce: bool) -> bool:
        """Whether this reduction of ``g`` (a ``ParamGroup``) goes through a replica bucket:
        a shard axis of one rank, replicas, and a plain all-reduce (not HSDP accumulation)."""
        return g.world == 1 and g.replicate_group is not None and all_reduce and not bucket.partial_over_replicas

    def reserve(self, g: ReducingUnit, bucket: Bucket) -> torch.Tensor:
        """A view of ``bucket.row`` elements in the open bucket for ``g``'s reduction of ``bucket``
        (the open one is issued first if it has no room or another dtype / group)."""
        key = (bucket.dtype, g.replicate_group, g.compute_device)
        n = bucket.row
        o = self._open
        if o is not None and (o.key != key or o.used + n > o.buffer.numel()):
            self.flush()
        if self._open is None:
            limit = (FIRST_BUCKET_BYTES if self._index == 0 else BUCKET_BYTES) // bucket.dtype.itemsize
            size = max(n, self._sizes.get(self._index, n + limit))
            buf = self._buffers.get(self._index)
            if (buf is None or buf.numel() < size or buf.dtype != bucket.dtype or buf.device != g.compute_device
                    or storage_shared(buf)):
                buf = torch.empty(size, dtype=bucket.dtype, device=g.compute_device)
                self._buffers[self._index] = buf
            self._open = _Open(key, buf, limit)
        o = self._open
        view = o.buffer[o.used : o.used + n]
        o.used += n
        return view

    def add(self, pr: PendingReduce) -> None:
        """``pr`` (a ``PendingReduce`` over the view ``reserve`` gave) joins the open bucket,
        which is issued once it holds its limit."""
        o = self._open
        assert o is not None, "reserve opened the bucket this reduction writes into"
        pr.bucketed = True
        o.members.append(pr)
        if o.used >= o.limit:
            self.flush()

    def flush(self) -> None:
        """Issue the open bucket's all-reduce (async); its members wait for it."""
        o, self._open = self._open, None
        if o is None:
            return
        g = o.members[-1].group
        with record_function(g.trace.all_reduce):
            work = dist.all_reduce(o.buffer[: o.used], group=o.key[1], async_op=True)
        for pr in o.members:
            pr.issued_all_reduce(work)
        self._sizes[self._index] = o.used
        self._index += 1

    def end_backward(self) -> None:
        """End of a backward: the last bucket is issued; the next backward starts at bucket 0."""
        self.flush()
        self._index = 0

    def drop(self) -> None:
        """A backward abandoned: forget the open bucket (its members are dropped by the caller)."""
        self._open = None
        self._index = 0
