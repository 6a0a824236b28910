"""The parameters of one ``fully_shard`` unit and the collectives that move them.

[Note: flat buffers]
One unit = one all-gather per unshard and one reduce-scatter per backward (per reduce dtype),
whatever the number of parameters. Every rank keeps one flat *byte* buffer for the unit,

    sharded_bytes = [ p_1 padded shard | p_2 padded shard | ... ]      (B bytes)

where parameter ``i`` takes ``pn_i = ceil(n_i / W) * row_numel_i`` elements of its own dtype
at an offset aligned to the unit's largest element size (see ``_layout.py``). Bytes, so that parameters of different
dtypes share one buffer and one all-gather. The DTensor local shards are typed views of it,
so the optimizer's in-place updates land there and, when no cast or device move is needed,
the all-gather input is the buffer itself (no copy). Under mixed precision the all-gather
input is a second byte buffer holding the shards cast to ``param_dtype``.

The all-gather of ``W`` such buffers gives a rank-major ``[W, B]`` byte matrix; parameter
``i`` is the column block at its offset, which viewed in its dtype and read row by row is the
padded parameter. One strided copy per parameter moves it into the parameter's own storage.

The reduce-scatter is the transpose, in elements of the reduce dtype: each unsharded gradient
is written (cast) into its column block of a ``[W, S]`` buffer (zero padding),
``reduce_scatter`` sums row ``r`` of every rank into rank ``r``, and the reduced shard of
parameter ``i`` is ``[o_i : o_i + rows_i * row_i]`` of the output. Only trainable parameters
take part; they are grouped by reduce dtype (one bucket in the usual case). On a 2-D
(replicate x shard) mesh the output is then all-reduced over the replicate axis. Gradients
are averaged over all ``R * W`` data-parallel ranks (as DDP does), so the result equals the
gradient of the mean loss over the global batch.

[Note: resharding onto a smaller group]
``reshard_after_forward=k`` (``1 < k < W``, ``W % k == 0``) keeps, after forward, ``1/k`` of the
all-gathered ``[W, B]`` matrix instead of ``1/W``: rank ``r`` keeps rows
``[j * W/k, (j+1) * W/k)`` with ``j = r mod k``, and the backward all-gather runs over the ``k``
consecutive ranks ``{k * (r // k), ..., k * (r // k) + k - 1}`` (usually one host), which
reassembles the same ``[W, B]`` matrix in the same order.

[Note: re-adopting parameters]
What the module holds between steps is the sharded parameter, a DTensor whose local tensor is
a view of ``sharded_bytes``. ``nn.Module._apply`` (``to_empty``, ``.to(dtype / device)``,
``.float()``...) swaps a new local tensor into that same Parameter object, and
``load_state_dict(assign=True)`` registers a new Parameter; either way the unit's buffer, the
offsets computed from the dtypes and the unsharded parameters would go stale (an all-gather
of meta or old fp32 bytes). ``FSDPModule._apply`` and a load-state-dict post-hook therefore
call ``readopt``: it recomputes the byte layout from the new dtypes, takes the new device as
the storage device, allocates a new buffer, copies each new local tensor (or the rows of a
full tensor) into it and points the parameter -- the same object when it was swapped, so an
optimizer built earlier keeps working -- at its segment. Unchanged parameters cost one
pointer comparison each; this never runs during a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._layout import DimZeroLayout, gather_rows, scatter_rows
from ._mesh_utils import all_gather_single, mesh_device, reduce_scatter_single
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._sharded_param import ShardedParam

__all__ = ["ParamGroup", "PendingReduce"]

def _byte_layout(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Offsets of consecutive segments of ``sizes`` bytes, each starting at a multiple of
    ``align`` (the largest element size in the unit, so every typed view is aligned and a
    single-dtype unit has no gaps at all)."""
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += -(-s // align) * align
    return offsets, total


@dataclass
class _Bucket:
    """Trainable parameters reduced together in one ``dtype`` reduce-scatter."""

    dtype: torch.dtype
    params: list[ShardedParam]
    offsets: list[int]
    numel: int
    partial_over_replicas: bool = False  # holds reduce-scattered but not yet all-reduced sums


@dataclass
class PendingReduce:
    """An issued reduce-scatter whose result still has to be averaged and stored."""

    group: "ParamGroup"
    bucket: _Bucket
    work: object
    out: torch.Tensor
    all_reduce: bool
    stage: str = "scatter"


class ParamGroup:
    """Parameters ``entries`` = ``[(fqn, param, uses), ...]`` of one unit, sharded over the
    last axis of ``mesh`` (and replicated over its first axis when the mesh is 2-D)."""

    def __init__(self, entries, mesh, *, mp: MixedPrecisionPolicy, offload: OffloadPolicy, label: str) -> None:
        self.mesh, self.mp, self.label = mesh, mp, label
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_world = mesh.size(0) if mesh.ndim == 2 else 1
        self.offload = isinstance(offload, CPUOffloadPolicy)
        self.compute_device = mesh_device(mesh)
        on_meta = entries[0][1].device.type == "meta"
        self.storage_device = torch.device("meta") if on_meta else (
            torch.device("cpu") if self.offload else self.compute_device)
        self.pin = self.offload and (offload.pin_memory if offload.pin_memory is not None
                                     else self.compute_device.type != "cpu")
        # a tensor-parallel DTensor is sharded on its TP-local shape
        layouts = [DimZeroLayout(tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape), self.world)
                   for _, p, _ in entries]
        dtypes = [p.dtype for _, p, _ in entries]
        cdtypes = [mp.param_dtype or d for d in dtypes]
        self._plan_bytes(layouts, dtypes, cdtypes)
        alias = self.world == 1 and self.zero_copy  # [Note: a shard of one rank]
        self.sharded_bytes = self._new_storage()
        self.params = [
            ShardedParam(fqn, p, uses, lay, self._segment(o, lay, d), mesh, self.rank, cd, self.compute_device, alias)
            for (fqn, p, uses), lay, o, d, cd in zip(entries, layouts, self.master_offsets, dtypes, cdtypes)
        ]
        self.buckets = self._make_buckets()
        self.is_unsharded = False
        self._pending = None  # (work, gathered bytes) of an issued all-gather
        self._post_forward = None  # (bytes, group) kept by reshard(to=...)

    # -- storage ---------------------------------------------------------------------------
    def _plan_bytes(self, layouts, dtypes, cdtypes) -> None:
        sizes = [lay.padded_numel * d.itemsize for lay, d in zip(layouts, dtypes)]
        self.master_offsets, self.master_bytes = _byte_layout(sizes, max(d.itemsize for d in dtypes))
        csizes = [lay.padded_numel * d.itemsize for lay, d in zip(layouts, cdtypes)]
        self.ag_offsets, self.ag_bytes = _byte_layout(csizes, max(d.itemsize for d in cdtypes))
        self.zero_copy = cdtypes == dtypes and self.storage_device == self.compute_device

    def readopt(self) -> None:
        """Re-adopt the parameters the modules hold now, after ``nn.Module._apply`` or
        ``load_state_dict(assign=True)`` replaced them or their local tensors: see
        [Note: re-adopting parameters]. Nothing to do (and no copy) when they are unchanged.
        Call it resharded (the sharded parameters registered)."""
        current = [p.registered() for p in self.params]
        if all(p.owns(c) for p, c in zip(self.params, current)):
            return
        locals_ = [c.to_local() if isinstance(c, DTensor) else c for c in current]
        devices = {t.device for t in locals_}
        if len(devices) > 1:
            raise ValueError(
                f"fully_shard({self.label}): after .to()/load_state_dict the unit's parameters are on several "
                f"devices {sorted(map(str, devices))}; move the whole unit (call .to() on its module)")
        self.storage_device = devices.pop()
        dtypes = [t.dtype for t in locals_]
        for p, d in zip(self.params, dtypes):
            p.orig_dtype, p.compute_dtype = d, self.mp.param_dtype or d
        self._plan_bytes([p.layout for p in self.params], dtypes, [p.compute_dtype for p in self.params])
        alias = self.world == 1 and self.zero_copy
        self.sharded_bytes = self._new_storage()
        for p, c, o in zip(self.params, current, self.master_offsets):
            p.alias = alias
            p.adopt(c, self._segment(o, p.layout, p.orig_dtype))
            p.register(unsharded=False)
        self.buckets = self._make_buckets()
        self._post_forward = None

    def _new_storage(self) -> torch.Tensor:
        t = torch.zeros(self.master_bytes, dtype=torch.uint8, device=self.storage_device)
        return t.pin_memory() if self.pin and t.device.type == "cpu" else t

    def _segment(self, offset: int, lay: DimZeroLayout, dtype: torch.dtype) -> torch.Tensor:
        return self.sharded_bytes[offset : offset + lay.padded_numel * dtype.itemsize].view(dtype)

    def materialize(self, full_tensors=None) -> None:
        """Give a unit built on the meta device real storage on its device, new sharded
        parameters pointing at it, filled from ``full_tensors`` (one per parameter or None)."""
        self.storage_device = torch.device("cpu") if self.offload else self.compute_device
        self.zero_copy = self.storage_device == self.compute_device and all(
            p.compute_dtype == p.orig_dtype for p in self.params)
        self.sharded_bytes = self._new_storage()
        fulls = full_tensors or [None] * len(self.params)
        for p, o, full in zip(self.params, self.master_offsets, fulls):
            p.set_storage(self._segment(o, p.layout, p.orig_dtype), full)
            if not self.is_unsharded:
                p.register(unsharded=False)

    def _make_buckets(self) -> list[_Bucket]:
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for p in self.params:
            if p.requires_grad:
                by_dtype.setdefault(self.mp.reduce_dtype or p.compute_dtype, []).append(p)
        buckets = []
        for dtype, params in by_dtype.items():
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.layout.padded_numel
            buckets.append(_Bucket(dtype, params, offsets, total))
        return buckets

    def _ag_block(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        p, o = self.params[i], self.ag_offsets[i]
        return rows[:, o : o + p.layout.padded_numel * p.compute_dtype.itemsize].view(p.compute_dtype)

    # -- unshard ---------------------------------------------------------------------------
    def _all_gather_input(self) -> torch.Tensor:
        if self.zero_copy:
            return self.sharded_bytes
        buf = torch.empty(self.ag_bytes, dtype=torch.uint8, device=self.compute_device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self._ag_block(buf.view(1, -1), i)[0].copy_(p.padded, non_blocking=self.pin)
        return buf

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (no-op if unsharded or already issued); wait unless async."""
        if not self.is_unsharded and self._pending is None and self.world == 1:
            # one rank: the "gathered" rows are this rank's own (cast) shards; no collective
            self._pending = (None, self.sharded_bytes if self.zero_copy else self._all_gather_input())
        if not self.is_unsharded and self._pending is None:
            gathered = torch.empty(self.world * self.ag_bytes, dtype=torch.uint8, device=self.compute_device)
            if self._post_forward is not None:
                src, group = self._post_forward
            else:
                src, group = self._all_gather_input(), self.shard_group
            work = all_gather_single(gathered, src, group=group, async_op=True)
            self._pending = (work, gathered)
        if not async_op:
            self.wait_unshard()

    @property
    def unshard_pending(self) -> bool:
        return self._pending is not None

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: copy each parameter out and register the unsharded
        parameters on their modules."""
        if self._pending is None:
            return
        work, gathered = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        self._post_forward = None
        rows = gathered.view(self.world, self.ag_bytes)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if not p.alias:
                    gather_rows(p.layout, self._ag_block(rows, i), p.alloc_unsharded())
        for p in self.params:
            p.register(unsharded=True)
        self.is_unsharded = True

    # -- reshard ---------------------------------------------------------------------------
    def reshard(self, to=None) -> None:
        """Free the unsharded parameters and register the sharded ones. ``to`` is a
        ``(group, k)`` pair to keep ``1/k`` of the unsharded data for a cheaper all-gather
        over that group (see [Note: resharding onto a smaller group])."""
        self.wait_unshard()
        if not self.is_unsharded:
            return
        if to is not None:
            group, k = to
            per = self.world // k
            lo = (self.rank % k) * per
            buf = torch.empty(per * self.ag_bytes, dtype=torch.uint8, device=self.compute_device)
            rows = buf.view(per, self.ag_bytes)
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    scatter_rows(p.layout, p.unsharded_data(), self._ag_block(rows, i), lo, lo + per)
            self._post_forward = (buf, group)
        for p in self.params:
            p.register(unsharded=False)
            p.free_unsharded()
        self.is_unsharded = False

    def drop_post_forward(self) -> None:
        self._post_forward = None

    # -- gradients -------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(p.unsharded.grad is not None for p in self.params)

    def reduce_grads(self, *, all_reduce: bool = True) -> list[PendingReduce]:
        """Issue the reduce-scatter of the unsharded gradients (one per bucket, async) and
        free them (frozen parameters never have one); ``advance_reduce`` stores the result. ``all_reduce=False`` (HSDP gradient
        accumulation) skips the replicate all-reduce until a later call asks for it."""
        if not self.has_unsharded_grads():
            return []
        W = self.world
        pending = []
        with torch.no_grad():
            for b in self.buckets:
                send = torch.empty(W * b.numel, dtype=b.dtype, device=self.compute_device)
                rows = send.view(W, b.numel)
                for p, o in zip(b.params, b.offsets):
                    block = rows[:, o : o + p.layout.padded_numel]
                    g = p.take_unsharded_grad(b.dtype)
                    if g is None:
                        block.zero_()
                    else:
                        scatter_rows(p.layout, g, block, 0, W)
                if W == 1:  # nothing to scatter: the sum over one rank is the input
                    pending.append(PendingReduce(self, b, None, send, all_reduce))
                    continue
                out = torch.empty(b.numel, dtype=b.dtype, device=self.compute_device)
                work = reduce_scatter_single(out, send, group=self.shard_group, async_op=True)
                pending.append(PendingReduce(self, b, work, out, all_reduce))
        return pending

    def advance_reduce(self, pr: PendingReduce) -> bool:
        """Move ``pr`` one stage on; True once its result is stored in the sharded ``.grad``.

        Stage "scatter": wait for the reduce-scatter and average; on a 2-D mesh issue the
        all-reduce across replicas asynchronously and stay pending (stage "all_reduce"), so it
        too runs behind the rest of backward. Stage "all_reduce": wait and store."""
        if pr.work is not None:
            pr.work.wait()
            pr.work = None
        out, b = pr.out, pr.bucket
        with torch.no_grad():
            if pr.stage == "all_reduce":
                self._store(b, out)
                return True
            out.div_(self.world * self.replicate_world)
            if self.replicate_group is None:
                self._store(b, out)
            elif not pr.all_reduce:  # HSDP accumulation: keep the replica-partial sum
                self._store(b, out)
                b.partial_over_replicas = True
            elif not b.partial_over_replicas:
                pr.work = dist.all_reduce(out, group=self.replicate_group, async_op=True)
                pr.stage = "all_reduce"
                return False
            else:  # last micro-batch: add it, then all-reduce the accumulated shards once
                self._store(b, out)
                self._all_reduce_sharded_grads(b)
                b.partial_over_replicas = False
        return True

    def finish_reduce(self, pr: PendingReduce) -> None:
        """Run ``pr`` to completion."""
        while not self.advance_reduce(pr):
            pass

    def _store(self, b: _Bucket, out: torch.Tensor) -> None:
        for p, o in zip(b.params, b.offsets):
            n = p.layout.shard_rows(self.rank) * p.layout.row_numel
            p.accumulate_sharded_grad(out[o : o + n].view(p.layout.shard_shape(self.rank)))

    def _all_reduce_sharded_grads(self, b: _Bucket) -> None:
        locals_ = [p.sharded.grad.to_local() for p in b.params]
        flat = torch.cat([t.reshape(-1).to(b.dtype) for t in locals_]).to(self.compute_device)
        dist.all_reduce(flat, group=self.replicate_group)
        for t, chunk in zip(locals_, flat.split([t.numel() for t in locals_])):
            t.copy_(chunk.view_as(t))
