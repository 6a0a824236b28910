"""The parameters of one ``fully_shard`` unit and the collectives that move them.

[Note: flat buffers]
One unit = one all-gather per unshard and one reduce-scatter per backward (per reduce dtype).
Every rank keeps one flat *byte* buffer for the unit,

    sharded_bytes = [ p_1 padded shard | p_2 padded shard | ... ]      (B bytes)

where parameter ``i`` takes ``pn_i = ceil(n_i / W) * row_numel_i`` elements of its own dtype
at an offset aligned to the unit's largest element size (``_layout.py``); bytes, so mixed dtypes
share one all-gather. The DTensor local shards are typed views of it, so optimizer updates land
there and, with no cast or device move, the all-gather input is the buffer itself. Under mixed
precision the all-gather input is a second buffer holding the shards cast to ``param_dtype``.
A parameter whose local shard has FSDP2's all-gather hooks owns its shard instead and adds the
pieces its ``fsdp_pre_all_gather`` returns after the other segments ([Note: the all-gather
extension] in ``_extension.py``).

The all-gather gives a rank-major ``[W, B]`` byte matrix; parameter ``i`` is the column block at
its offset, read row by row as the padded parameter (one strided copy into its storage). The
reduce-scatter is the transpose, in the reduce dtype: each gradient is cast into its column block
of a ``[W, S]`` buffer, ``reduce_scatter`` sums row ``r`` into rank ``r``. Only trainable
parameters take part, grouped by reduce dtype. On a 2-D (replicate x shard) mesh the output is
then all-reduced over the replicate axis. Gradients are averaged over all ``R * W`` ranks (as
DDP does): the gradient of the mean loss over the global batch.

[Note: resharding onto a smaller group]
``reshard_after_forward=k`` (``1 < k < W``, ``W % k == 0``) keeps ``1/k`` of the ``[W, B]``
matrix after forward: rank ``r`` keeps rows ``[j * W/k, (j+1) * W/k)`` with ``j = r mod k``, and
the backward all-gather runs over the ``k`` consecutive ranks starting at ``k * (r // k)``
(usually one host), reassembling the same matrix in the same order.

[Note: re-adopting parameters]
Between steps the module holds sharded parameters whose local tensors view ``sharded_bytes``.
``nn.Module._apply`` (``to_empty``, ``.to(...)``, ``.float()``) swaps a new local tensor into the
same Parameter, and ``load_state_dict(assign=True)`` registers a new one; either way the buffer
and offsets would go stale. ``FSDPModule._apply`` and a load-state-dict post-hook therefore call
``readopt``: recompute the byte layout, take the new device as storage device, copy each new
local tensor into a new buffer and point the parameter (the same object when swapped, so an
existing optimizer keeps working) at its segment. Unchanged parameters cost one pointer
comparison; this never runs during a step.

[Note: a unit moved one module at a time]
A list unit (``fully_shard([norm, output])``) spans several modules, which ``to_empty()`` /
``to()`` / ``load_state_dict`` visit one at a time, leaving the unit on two devices in between.
``readopt(partial_ok=True)`` leaves such a unit as it is (``readopt_pending``) and re-adopts it
whole once its last module moved. A unit used while still split is refused by its next
all-gather: one ``ValueError`` naming the unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from ._comm import CommOptions, all_gather
from ._common import SHARD_NEXT, ParamEntry, ShardState, TraceNames
from ._extension import has_extension
from ._layout import ShardLayout, byte_columns, make_layout
from ._layout import byte_layout as _byte_layout
from .._mesh_utils import all_gather_single, mesh_device
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._reduce import PendingReduce, make_buckets, reduce_grads
from ._sharded_param import ShardedParam

__all__ = ["ParamGroup", "ShardState"]


class ParamGroup:
    """Parameters ``entries`` = ``[(fqn, param, uses), ...]`` of one unit, sharded over the
    last axis of ``mesh`` (and replicated over its first axis when the mesh is 2-D)."""

    def __init__(self, entries: list[ParamEntry], mesh: DeviceMesh, *, mp: MixedPrecisionPolicy, offload: OffloadPolicy, label: str,
                 placements: list[Shard | None] | None = None) -> None:
        self.mesh, self.mp, self.label = mesh, mp, label
        self.trace = TraceNames.for_unit(label)  # the root renames it by module path at lazy init
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
        pin = offload.pin_memory if isinstance(offload, CPUOffloadPolicy) else None
        self.pin = self.offload and (pin if pin is not None else self.compute_device.type != "cpu")
        # a tensor-parallel DTensor is sharded on its TP-local shape
        placements = placements or [None] * len(entries)
        layouts = [make_layout(tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape), self.world, pl)
                   for (_, p, _), pl in zip(entries, placements)]
        dtypes = [p.dtype for _, p, _ in entries]
        cdtypes = [mp.param_dtype or d for d in dtypes]
        # [Note: the all-gather extension] in _extension.py: no bytes of the sharded buffer
        self.extended = [has_extension(p.to_local() if isinstance(p, DTensor) else p, fqn) for fqn, p, _ in entries]
        if any(self.extended) and self.offload:
            raise ValueError(f"fully_shard({label}): CPU offload of tensor-subclass parameters with "
                             "fsdp_pre_all_gather is not supported yet; shard them without offload_policy")
        self._plan_bytes(layouts, dtypes, cdtypes)
        alias = self.world == 1 and self.zero_copy  # [Note: a shard of one rank]
        self.sharded_bytes = self._new_storage()
        self.params = [
            ShardedParam(fqn, p, uses, lay, self._segment(o, lay, d, e), mesh, self.rank, cd, self.compute_device, alias)
            for (fqn, p, uses), lay, o, d, cd, e in zip(entries, layouts, self.master_offsets, dtypes, cdtypes,
                                                        self.extended)
        ]
        self.buckets = make_buckets(self.params, mp.reduce_dtype)
        # FSDP2's set_reduce_scatter_unused_params: unused parameters get zero gradients
        # instead of None ([Note: unused parameters] in _reduce.py)
        self.reduce_scatter_unused_params = False
        self.comm = CommOptions()  # what the FSDPModule setters change about the collectives
        self.state = ShardState.SHARDED
        self.readopt_pending = False  # [Note: a unit moved one module at a time]
        # (work, gathered bytes) of an issued all-gather (GATHERING)
        self._pending: tuple[Any, torch.Tensor] | None = None
        # (bytes, group) kept by reshard(to=...) (SHARDED_POST_FORWARD)
        self._post_forward: tuple[torch.Tensor, Any] | None = None

    def _to(self, state: ShardState) -> None:
        if state not in SHARD_NEXT[self.state]:
            raise AssertionError(f"fully_shard({self.label}): parameters {self.state.name} -> {state.name}")
        self.state = state

    @property
    def is_unsharded(self) -> bool:
        return self.state is ShardState.UNSHARDED

    @property
    def unshard_pending(self) -> bool:
        return self.state is ShardState.GATHERING

    # -- storage ---------------------------------------------------------------------------
    def _plan_bytes(self, layouts: Sequence[ShardLayout], dtypes: list[torch.dtype], cdtypes: list[torch.dtype]) -> None:
        # a parameter with the all-gather extension owns its shard (0 bytes here) and its
        # all-gather pieces are planned at each unshard (`_plan_pieces`)
        sizes = [0 if e else lay.padded_numel * d.itemsize for lay, d, e in zip(layouts, dtypes, self.extended)]
        self.master_offsets, self.master_bytes = _byte_layout(sizes, max(d.itemsize for d in dtypes))
        self._ag_sizes = [0 if e else lay.padded_numel * d.itemsize for lay, d, e in zip(layouts, cdtypes, self.extended)]
        self._ag_align = max(d.itemsize for d in cdtypes)
        self.ag_offsets, self.ag_bytes = _byte_layout(self._ag_sizes, self._ag_align)
        self.zero_copy = cdtypes == dtypes and self.storage_device == self.compute_device and not any(self.extended)
        self._pieces: list[tuple[int, list[tuple[int, int, torch.dtype]]]] = []  # (param, [(offset, numel, dtype)])

    def _shard_mesh(self) -> DeviceMesh:
        names = self.mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"fully_shard({self.label}): fsdp_pre_all_gather takes the shard axis as a 1-D mesh; "
                             "name the dims of the 2-D mesh (init_device_mesh(..., mesh_dim_names=...)), as FSDP2 needs")
        return self.mesh[names[-1]]

    def _plan_pieces(self) -> list[list[torch.Tensor]]:
        """Call every extension parameter's ``fsdp_pre_all_gather`` and lay its pieces out after
        the plain parameters' segments of the all-gather buffer (the same `byte_layout`)."""
        shard_mesh = self.mesh if self.mesh.ndim == 1 else self._shard_mesh()
        inputs = [(i, self.params[i].gather_inputs(shard_mesh, self.mp)) for i, e in enumerate(self.extended) if e]
        flat = [t for _, ts in inputs for t in ts]
        align = max([self._ag_align] + [t.element_size() for t in flat])
        offsets, self.ag_bytes = _byte_layout(self._ag_sizes + [t.numel() * t.element_size() for t in flat], align)
        self.ag_offsets = offsets[: len(self.params)]
        it = iter(offsets[len(self.params):])
        self._pieces = [(i, [(next(it), t.numel(), t.dtype) for t in ts]) for i, ts in inputs]
        return [ts for _, ts in inputs]

    def readopt(self, partial_ok: bool = False) -> None:
        """Re-adopt the parameters the modules hold now, after ``nn.Module._apply`` or
        ``load_state_dict(assign=True)`` replaced them or their local tensors: see
        [Note: re-adopting parameters]. Nothing to do (and no copy) when they are unchanged.
        Call it resharded (the sharded parameters registered). Parameters on several devices
        are a ``ValueError``, or with ``partial_ok`` (after one module of a list unit moved)
        are left for the next call ([Note: a unit moved one module at a time])."""
        current = [p.registered() for p in self.params]
        if all(p.owns(c) for p, c in zip(self.params, current)):
            self.readopt_pending = False
            return
        locals_ = [c.to_local() if isinstance(c, DTensor) else c for c in current]
        devices = {t.device for t in locals_}
        self.readopt_pending = len(devices) > 1
        if self.readopt_pending and partial_ok:
            return
        if self.readopt_pending:
            raise ValueError(
                f"fully_shard({self.label}): the unit's parameters are on several devices {sorted(map(str, devices))}: "
                "only some of its modules were moved (.to(), to_empty(), load_state_dict(assign=True)); move "
                "every module of the unit, e.g. call .to() / to_empty() on a module above them all")
        self.storage_device = devices.pop()
        dtypes = [t.dtype for t in locals_]
        for p, d in zip(self.params, dtypes):
            p.orig_dtype, p.compute_dtype = d, self.mp.param_dtype or d
        self._plan_bytes([p.layout for p in self.params], dtypes, [p.compute_dtype for p in self.params])
        alias = self.world == 1 and self.zero_copy
        self.sharded_bytes = self._new_storage()
        for p, c, o, e in zip(self.params, current, self.master_offsets, self.extended):
            p.alias = alias
            p.adopt(c, self._segment(o, p.layout, p.orig_dtype, e))
            p.register(unsharded=False)
        self.buckets = make_buckets(self.params, self.mp.reduce_dtype)
        self.drop_post_forward()

    def adopt_replaced(self) -> None:
        """At the root's lazy init: take parameters set on the modules since ``fully_shard``
        (``module.weight = nn.Parameter(...)``, a common re-init pattern after a meta-device
        ``fully_shard``) as FSDP2 does ([Note: re-adopting parameters]); then refuse, naming
        them, parameters that are still on the meta device."""
        if self.state is not ShardState.SHARDED:
            return  # unsharded by the user before the first forward: the modules hold the gathered ones
        if self.readopt_pending:  # only some of a list unit's modules moved
            self.readopt()
        current = [p.registered() for p in self.params]
        meta = [p.fqn for p, c in zip(self.params, current) if c.device.type == "meta"]
        if not meta:
            self.readopt()
            meta = [p.fqn for p in self.params if p.padded.device.type == "meta"]
        if meta:
            raise RuntimeError(
                f"fully_shard({self.label}): parameters {meta} are still on the meta device at the first forward; "
                "materialize them first: module.to_empty(device=...) and then initialize them (reset_parameters() "
                "or load a state dict), or shardwise.composable.materialize(module)")

    def _new_storage(self) -> torch.Tensor:
        t = torch.zeros(self.master_bytes, dtype=torch.uint8, device=self.storage_device)
        return t.pin_memory() if self.pin and t.device.type == "cpu" else t

    def _segment(self, offset: int, lay: ShardLayout, dtype: torch.dtype, extended: bool = False) -> torch.Tensor:
        n = 0 if extended else lay.padded_numel * dtype.itemsize  # an extension parameter owns its shard
        return self.sharded_bytes[offset : offset + n].view(dtype)

    def materialize(self, full_tensors: list[torch.Tensor | None] | None = None) -> None:
        """Give a unit built on the meta device real storage on its device, new sharded
        parameters pointing at it, filled from ``full_tensors`` (one per parameter or None)."""
        if any(self.extended):
            raise NotImplementedError(
                f"fully_shard({self.label}): materialize() does not support tensor-subclass parameters with "
                "fsdp_pre_all_gather; call module.to_empty(device=...) and initialise them, as with FSDP2")
        self.storage_device = torch.device("cpu") if self.offload else self.compute_device
        self.readopt_pending = False  # every parameter gets new storage here
        self.zero_copy = self.storage_device == self.compute_device and all(
            p.compute_dtype == p.orig_dtype for p in self.params)
        self.sharded_bytes = self._new_storage()
        fulls = full_tensors or [None] * len(self.params)
        for p, o, full in zip(self.params, self.master_offsets, fulls):
            p.set_storage(self._segment(o, p.layout, p.orig_dtype), full)
            if not self.is_unsharded:
                p.register(unsharded=False)

    def gather_original(self, fulls: list[torch.Tensor]) -> None:
        """Write each parameter's full value, in its original dtype, into ``fulls`` (one
        full-size tensor per parameter): one all-gather of the sharded bytes. Collective over
        the shard axis; the unit's own state is unchanged (deferred init restores with it)."""
        if self.readopt_pending:
            self.readopt()
        work, gathered = all_gather(self.comm, self.world * self.master_bytes, self._flat_shards(), self.shard_group,
                                    self.sharded_bytes.device, all_gather_single)
        if work is not None:
            work.wait()
        rows = gathered.view(self.world, self.master_bytes)
        with torch.no_grad():
            for p, o, full in zip(self.params, self.master_offsets, fulls):
                p.layout.gather(byte_columns(rows, o, p.layout, p.orig_dtype), full)

    def _ag_block(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return byte_columns(rows, self.ag_offsets[i], p.layout, p.compute_dtype)

    # -- unshard ---------------------------------------------------------------------------
    def _flat_shards(self) -> torch.Tensor:
        """The flat sharded buffer, with the shards whose storage was moved into shared memory
        copied back in first ([Note: ordinary tensors] in ``_sharded_param.py``)."""
        if self.storage_device.type == "cpu":
            with torch.no_grad():
                for p in self.params:
                    if p.moved():
                        p.segment.copy_(p.padded)
        return self.sharded_bytes

    def _all_gather_input(self) -> torch.Tensor:
        if self.zero_copy:
            return self._flat_shards()
        pieces = self._plan_pieces() if any(self.extended) else []
        buf = torch.empty(self.ag_bytes, dtype=torch.uint8, device=self.compute_device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if not self.extended[i]:
                    self._ag_block(buf.view(1, -1), i)[0].copy_(p.padded, non_blocking=self.pin)
            for (_, plan), ts in zip(self._pieces, pieces):
                for (o, n, d), t in zip(plan, ts):
                    buf[o : o + n * d.itemsize].view(d).copy_(t)
        return buf

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (no-op if unsharded or already issued); wait unless async."""
        if self.readopt_pending:
            self.readopt()
        if self.state is ShardState.GATHERING or self.state is ShardState.UNSHARDED:
            pass
        elif self.world == 1:
            # one rank: the "gathered" rows are this rank's own (cast) shards; no collective
            self._pending = (None, self._all_gather_input())
            self._to(ShardState.GATHERING)
        else:
            with record_function(self.trace.all_gather):
                if self._post_forward is not None:
                    src, group = self._post_forward
                else:
                    src, group = self._all_gather_input(), self.shard_group
                work, gathered = all_gather(self.comm, self.world * self.ag_bytes, src, group, self.compute_device,
                                            all_gather_single)
            self._pending = (work, gathered)
            self._to(ShardState.GATHERING)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: copy each parameter out and register the unsharded
        parameters on their modules."""
        if self.state is not ShardState.GATHERING:
            return
        assert self._pending is not None, "GATHERING has an all-gather in flight"
        work, gathered = self._pending
        self._pending = None
        if work is not None:
            with record_function(self.trace.all_gather_wait):
                work.wait()
        self._post_forward = None
        rows = gathered.view(self.world, self.ag_bytes)
        with torch.no_grad(), record_function(self.trace.copy_out):
            for i, p in enumerate(self.params):
                if not p.alias and not self.extended[i]:
                    p.layout.gather(self._ag_block(rows, i), p.alloc_unsharded())
            for i, plan in self._pieces:
                p = self.params[i]
                assert p.ext is not None
                outs = p.ext.outputs_for(self.world, [(n, d) for _, n, d in plan], self.compute_device)
                for (o, n, d), out in zip(plan, outs):
                    out.view(self.world, n).copy_(rows[:, o : o + n * d.itemsize].view(d))
            for i, _ in self._pieces:  # [Note: the all-gather extension] in _extension.py
                self.params[i].rebuild_unsharded()
        for p in self.params:
            p.register(unsharded=True)
        self._to(ShardState.UNSHARDED)

    # -- reshard ---------------------------------------------------------------------------
    def reshard(self, to: tuple[Any, int] | None = None) -> None:
        """Free the unsharded parameters and register the sharded ones. ``to`` is a
        ``(group, k)`` pair to keep ``1/k`` of the unsharded data for a cheaper all-gather
        over that group (see [Note: resharding onto a smaller group])."""
        self.wait_unshard()
        if not self.is_unsharded:
            return
        if to is not None and any(self.extended):
            raise ValueError(f"fully_shard({self.label}): reshard_after_forward=<int> is not supported for "
                             "tensor-subclass parameters with fsdp_pre_all_gather (nor by FSDP2); use True or False")
        if to is not None:
            group, k = to
            per = self.world // k
            lo = (self.rank % k) * per
            buf = torch.empty(per * self.ag_bytes, dtype=torch.uint8, device=self.compute_device)
            rows = buf.view(per, self.ag_bytes)
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.layout.scatter(p.unsharded_data(), self._ag_block(rows, i), lo, lo + per)
            self._post_forward = (buf, group)
        for p in self.params:
            p.register(unsharded=False)
            p.free_unsharded()
        self._to(ShardState.SHARDED if to is None else ShardState.SHARDED_POST_FORWARD)

    def drop_post_forward(self) -> None:
        """Forget the rows ``reshard(to=...)`` kept (the next all-gather is the full one)."""
        self._post_forward = None
        if self.state is ShardState.SHARDED_POST_FORWARD:
            self._to(ShardState.SHARDED)

    # -- gradients -------------------------------------------------------------------------
    def has_unsharded_grads(self) -> bool:
        return any(p.unsharded.grad is not None or p.accumulated_grad is not None for p in self.params)

    def drop_unsharded_grads(self) -> None:
        """Forget the unsharded gradients without reducing them (a backward that raised)."""
        for p in self.params:
            p.unsharded.grad = None
            p.accumulated_grad = None
        for b in self.buckets:
            b.seen, b.fresh, b.used_here = None, set(), set()

    def stash_unsharded_grads(self) -> None:
        """After a backward that does not reduce: keep each gradient's running sum in its
        bucket's (reduce) dtype; see [Note: accumulating in the reduce dtype] in ``_sharded_param.py``."""
        for b in self.buckets:
            for p in b.params:
                p.stash_unsharded_grad(b.dtype)

    def reduce_grads(self, *, all_reduce: bool = True, replica_buckets: Any = None) -> list[PendingReduce]:
        """Issue the reduce-scatter of the unsharded gradients (one per bucket, async) and
        free them; ``PendingReduce.advance`` stores the result (see [Note: the reduction
        pipeline] in ``_reduce.py``). ``all_reduce=False`` (HSDP gradient accumulation) skips
        the replicate all-reduce until a later call asks for it."""
        if not self.has_unsharded_grads():
            return []
        return reduce_grads(self, all_reduce=all_reduce, replica_buckets=replica_buckets)
