"""``clip_grad_norm_`` over gradients sharded on any meshes: the true global norm, few collectives.

[Note: the norm of sharded gradients]
For finite ``p``, ``||g||_p^p`` is a sum over elements, so it splits over a sharded gradient's
pieces: each rank sums ``|local|^p`` over its ``to_local()`` (never padding) and a SUM over the
*Shard* axes adds the pieces; *Replicate* axes are skipped (the same piece would count several
times). For ``p = inf`` the same holds with MAX. A *Partial* gradient is first redistributed to
Replicate on those axes (one all-reduce each; fully_shard never produces one). Gradients are
grouped by the process groups to reduce over, with one all-reduce per group and mesh axis
whatever the number of parameters. Plain-tensor gradients are taken as replicated, not reduced.

[Note: the returned norm]
As torch's ``clip_grad_norm_`` on DTensor gradients (code calls ``total_norm.full_tensor()``),
when this rank holds a piece of some DTensor gradient the norm is a 0-d DTensor on the first
such gradient's mesh, ``Replicate()`` on every axis, its local value the global norm (for ``p =
inf`` torch gives ``Partial(max)``, whose ``to_local()`` is only the local maximum: ours is
``Replicate`` there too). With no DTensor gradient the result is a plain tensor, as torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ._compat import foreach_mul_, foreach_norm, is_strided_shard

__all__ = ["clip_grad_norm_"]


def _local_grads(parameters: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, tuple]], DeviceMesh | None]:
    """``[(tensor to measure, reduce key)]``, the key being the tuple of process groups to reduce
    over; and the mesh of the first DTensor gradient this rank holds a piece of (None if none)."""
    out: list[tuple[torch.Tensor, tuple]] = []
    first_mesh: DeviceMesh | None = None
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            out.append((g.detach(), ()))
            continue
        mesh = g.device_mesh
        if mesh.get_coordinate() is None:
            continue  # this rank holds no piece of it
        first_mesh = first_mesh or mesh
        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
        axes = tuple(mesh.get_group(i) for i, pl in enumerate(g.placements)
                     if (pl.is_shard() or is_strided_shard(pl)) and mesh.size(i) > 1)
        out.append((g.to_local().detach(), axes))
    return out, first_mesh


def _norms(tensors: list[torch.Tensor], p: float, foreach: bool | None) -> list[torch.Tensor]:
    """Per-tensor ``p``-norms in fp32 (fp64 for fp64 tensors); 0 for empty tensors (an empty
    shard of a trailing rank), which have no inf-norm of their own."""
    wide = [torch.promote_types(t.dtype, torch.float32) for t in tensors]
    norms = [torch.zeros((), dtype=w, device=t.device) for t, w in zip(tensors, wide)]
    todo = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if foreach is None:
        foreach = all(tensors[i].device.type not in ("cpu", "meta") for i in todo)
    if not foreach:
        for i in todo:
            norms[i] = torch.linalg.vector_norm(tensors[i], p, dtype=wide[i])
        return norms
    by_kind: dict[tuple, list[int]] = {}
    for i in todo:
        by_kind.setdefault((tensors[i].device, tensors[i].dtype), []).append(i)
    for idx in by_kind.values():
        for i, n in zip(idx, foreach_norm([tensors[i] for i in idx], p)):
            norms[i] = n.to(wide[i])
    return norms


def _reduce(value: torch.Tensor, groups: tuple, op) -> torch.Tensor:
    """All-reduce ``value`` over each group in turn (distinct axes of one mesh)."""
    for group in groups:
        dist.all_reduce(value, op=op, group=group)
    return value


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh=None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that their global norm is at most
    ``max_norm``; return that norm (before clipping), equal on every rank: as torch does, a 0-d
    DTensor when the gradients are DTensors (``total_norm.full_tensor()`` / ``.item()`` read it),
    else a plain 0-d tensor; see [Note: the returned norm].

    Gradients may be DTensors on any meshes and placements (several at once) or plain tensors,
    taken as replicated. The norm is that of all gradients concatenated, as on one device
    ([Note: the norm of sharded gradients]). Every rank must call it with the same kinds of
    gradients (it communicates).

    Args:
        max_norm: the largest allowed norm; grads are multiplied by
            ``min(1, max_norm / (norm + 1e-6))``, as torch does.
        norm_type: ``p`` of the p-norm: a positive float, or ``inf`` for the max-abs norm.
        error_if_nonfinite: raise ``RuntimeError`` if the norm is nan or inf (on every rank,
            since the norm is global); otherwise clipping with a nonfinite norm makes nans.
        foreach: use the fused multi-tensor (foreach) kernels; None: on accelerators only.
        pp_mesh: under pipeline parallelism, the ``pp`` mesh (``shardwise.mesh.pipeline_mesh``)
            or its process group: each rank holds only its stages' gradients, so the per-rank
            sums (max for ``inf``) are also reduced over it, giving the norm over all stages.
            Every rank of the pipeline must call it (a rank with no gradients too).

    The norm is computed in fp32 (fp64 if a gradient is fp64) on the device of the first
    gradient; with no gradients it is 0.
    """
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r}; use a positive number or float('inf')")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    entries, mesh = _local_grads(params)
    pp_group = None
    if pp_mesh is not None:
        pp_group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
    if not entries and pp_group is None:
        return torch.tensor(0.0)
    if not entries:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" \
            else torch.device("cpu")
    else:
        device = entries[0][0].device
    dtype = torch.float64 if any(t.dtype == torch.float64 for t, _ in entries) else torch.float32
    if pp_group is not None:
        dtype = torch.float64  # every rank of the pipeline must reduce the same dtype
    norms = _norms([t for t, _ in entries], p, foreach)
    inf = math.isinf(p)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for (_, key), n in zip(entries, norms):
        by_key.setdefault(key, []).append(n.to(device=device, dtype=dtype))
    parts = []
    for key, ns in by_key.items():
        stacked = torch.stack(ns)
        local = stacked.max() if inf else stacked.pow(p).sum()
        parts.append(_reduce(local, key, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM))
    stacked = torch.stack(parts) if parts else torch.zeros(1, dtype=dtype, device=device)
    local_total = stacked.max() if inf else stacked.sum()
    if pp_group is not None:
        local_total = _reduce(local_total.clone(), (pp_group,), dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    total = local_total if inf else local_total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total.item()}, so they "
            "cannot be clipped. Find the nan/inf gradient (loss scale, a bad batch), or pass "
            "error_if_nonfinite=False to clip anyway (the gradients become nan).")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    _scale_(params, coef, foreach)
    if mesh is None:
        return total
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _scale_(parameters, coef: torch.Tensor, foreach: bool | None) -> None:
    """Multiply every gradient's local tensor by ``coef`` in place (scaling each piece of a
    sharded or partial gradient scales the whole)."""
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for param in parameters:
        g = param.grad
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), tensors in by_device.items():
        c = coef.to(device=device, dtype=dtype)
        if foreach or (foreach is None and device.type not in ("cpu", "meta")):
            foreach_mul_(tensors, c)
        else:
            for t in tensors:
                t.mul_(c)
