"""The parameters of one ``fully_shard`` unit and the collectives that move them.

[Note: flat buffers]
One unit = one all-gather per unshard and one reduce-scatter per backward, whatever the
number of parameters. Every rank keeps one flat sharded buffer for the unit,

    sharded_flat = [ p_1 padded shard | p_2 padded shard | ... ]      (S elements)

where parameter ``i`` takes ``pn_i = ceil(n_i / W) * row_numel_i`` elements at offset ``o_i``
(see ``_layout.py``). The DTensor local shards are views of it, so the optimizer's in-place
updates land there and the all-gather input needs no copy. The all-gather of ``W`` such
buffers gives a rank-major ``[W, S]`` matrix; parameter ``i`` is the column block
``[:, o_i : o_i + pn_i]``, which read row by row is the padded parameter. One strided copy
per parameter moves it into the parameter's own storage (``gather_rows``).

The reduce-scatter is the transpose: each unsharded gradient is written into its column block
of a ``[W, S]`` buffer (zero padding), ``reduce_scatter`` sums row ``r`` of every rank into
rank ``r``, and the reduced shard of parameter ``i`` sits at ``[o_i : o_i + rows_i * row_i]``
of the output. On a 2-D (replicate x shard) mesh the output is then all-reduced over the
replicate axis. Gradients are averaged over all ``R * W`` data-parallel ranks (as DDP does),
so the result equals the gradient of the mean loss over the global batch.

[Note: resharding onto a smaller group]
``reshard_after_forward=k`` (``1 < k < W``, ``W % k == 0``) keeps, after forward, ``1/k`` of the
all-gathered ``[W, S]`` matrix instead of ``1/W``: rank ``r`` keeps rows
``[j * W/k, (j+1) * W/k)`` with ``j = r mod k``, and the backward all-gather runs over the ``k``
consecutive ranks ``{k * (r // k), ..., k * (r // k) + k - 1}`` (usually one host), which
reassembles the same ``[W, S]`` matrix in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._layout import DimZeroLayout, gather_rows, scatter_rows
from ._mesh_utils import mesh_device
from ._sharded_param import ShardedParam

__all__ = ["ParamGroup"]


class ParamGroup:
    """Parameters ``entries`` = ``[(fqn, param, uses), ...]`` of one unit, sharded over the
    last axis of ``mesh`` (and replicated over its first axis when the mesh is 2-D)."""

    def __init__(self, entries, mesh) -> None:
        self.mesh = mesh
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_world = mesh.size(0) if mesh.ndim == 2 else 1
        first = entries[0][1]
        self.dtype = first.dtype
        device = mesh_device(mesh) if first.device.type != "meta" else first.device
        layouts = [DimZeroLayout(tuple(p.shape), self.world) for _, p, _ in entries]
        self.offsets, total = [], 0
        for lay in layouts:
            self.offsets.append(total)
            total += lay.padded_numel
        self.shard_numel = total
        self.sharded_flat = torch.zeros(total, dtype=self.dtype, device=device)
        self.params = [
            ShardedParam(fqn, p, uses, lay, self.sharded_flat[o : o + lay.padded_numel], mesh, self.rank)
            for (fqn, p, uses), lay, o in zip(entries, layouts, self.offsets)
        ]
        self.is_unsharded = False
        self._pending = None  # (work, gathered [W * S]) of an issued all-gather
        self._post_forward = None  # (buffer, group) kept by reshard(to=...)

    # -- unshard ---------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (no-op if unsharded or already issued); wait unless async."""
        if not self.is_unsharded and self._pending is None:
            gathered = torch.empty(self.world * self.shard_numel, dtype=self.dtype, device=self.sharded_flat.device)
            if self._post_forward is not None:
                src, group = self._post_forward
            else:
                src, group = self.sharded_flat, self.shard_group
            work = dist.all_gather_single(gathered, src, group=group, async_op=True)
            self._pending = (work, gathered)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: copy each parameter out and register the unsharded
        parameters on their modules."""
        if self._pending is None:
            return
        work, gathered = self._pending
        self._pending = None
        work.wait()
        self._post_forward = None
        rows = gathered.view(self.world, self.shard_numel)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                gather_rows(p.layout, rows[:, o : o + p.layout.padded_numel], p.alloc_unsharded())
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
            buf = torch.empty(per * self.shard_numel, dtype=self.dtype, device=self.sharded_flat.device)
            rows = buf.view(per, self.shard_numel)
            with torch.no_grad():
                for p, o in zip(self.params, self.offsets):
                    scatter_rows(p.layout, p.unsharded.data, rows[:, o : o + p.layout.padded_numel], lo, lo + per)
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

    def reduce_grads(self) -> None:
        """Reduce-scatter the unsharded gradients (and all-reduce over the replicate axis);
        the averaged shards become (or are added to) the sharded parameters' ``.grad``."""
        if not self.has_unsharded_grads():
            return
        W, S = self.world, self.shard_numel
        send = torch.empty(W * S, dtype=self.dtype, device=self.sharded_flat.device)
        rows = send.view(W, S)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                block = rows[:, o : o + p.layout.padded_numel]
                g = p.unsharded.grad
                if g is None:
                    block.zero_()
                else:
                    scatter_rows(p.layout, g, block, 0, W)
                p.unsharded.grad = None
            reduced = torch.empty(S, dtype=self.dtype, device=send.device)
            dist.reduce_scatter_single(reduced, send, group=self.shard_group)
            del send, rows
            if self.replicate_group is not None:
                dist.all_reduce(reduced, group=self.replicate_group)
            reduced.div_(W * self.replicate_world)
            for p, o in zip(self.params, self.offsets):
                if p.requires_grad:
                    n = p.layout.shard_rows(self.rank) * p.layout.row_numel
                    p.accumulate_sharded_grad(reduced[o : o + n].view(p.layout.shard_shape(self.rank)))
