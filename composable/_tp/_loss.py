"""Cross-entropy over class-sharded logits, without gathering the classes.

Logits ``z`` of ``C`` classes are split over ``p`` ranks (``Shard`` on the class dimension, a
`ColwiseParallel` head with ``use_local_output=False``); rank ``r`` holds classes ``[o_r, o_r +
n_r)``. For each sample with target ``y``:

    m    = max_c z_c                      all-reduce MAX of the local maxima
    S    = sum_c exp(z_c - m)             all-reduce SUM of the local sums
    z_y  = the target logit               all-reduce SUM (only its owner adds a nonzero)
    loss = log S + m - z_y                (+ label smoothing eps: (1-eps) loss
                                           + eps (log S + m - mean_c z_c), mean_c via the same SUM)

Forward: all-reduces of ``N`` (MAX) and ``2N`` or ``3N`` (SUM) floats instead of gathering
``N x C`` logits. Backward: no collective (``dz_c = g (softmax_c - (1-eps) [c = y] - eps / C)``
on each rank's own classes). Entry points: `vocab_parallel_cross_entropy`, and `loss_parallel`,
inside which ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on such a DTensor route here (and
``F.log_softmax`` / ``F.nll_loss`` to their sharded forms). The result is a ``Replicate``
DTensor; the backward may run outside the context.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from ._layouts import local_shard_range, normalize

__all__ = ["vocab_parallel_cross_entropy", "loss_parallel"]


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-sample loss from local logits ``[N, n_r]`` (fp32 or fp64) and global targets ``[N]``."""

    @staticmethod
    def forward(ctx, z, target, start, n_classes, group, ignore_index, smoothing):
        n_local = z.shape[1]
        valid = target != ignore_index
        local_t = target - start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        zmax = z.amax(dim=1) if n_local else z.new_full((z.shape[0],), float("-inf"))
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        shifted = z - zmax.unsqueeze(1)
        picked = shifted.gather(1, local_t.clamp(0, max(n_local - 1, 0)).unsqueeze(1)).squeeze(1) \
            if n_local else shifted.new_zeros(z.shape[0])
        parts = [shifted.exp().sum(dim=1), torch.where(mine, picked, 0.0)]
        if smoothing:
            parts.append(shifted.sum(dim=1))
        stats = torch.stack(parts)
        dist.all_reduce(stats, group=group)
        log_s = stats[0].log()
        loss = log_s - stats[1]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (log_s - stats[2] / n_classes)
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(shifted, log_s, local_t, mine, valid)
        ctx.smoothing, ctx.n_classes = smoothing, n_classes
        return loss

    @staticmethod
    def backward(ctx, grad):
        shifted, log_s, local_t, mine, valid = ctx.saved_tensors
        dz = (shifted - log_s.unsqueeze(1)).exp()
        if ctx.smoothing:
            dz -= ctx.smoothing / ctx.n_classes
        rows = mine.nonzero().squeeze(1)
        dz[rows, local_t[rows]] -= 1 - ctx.smoothing
        dz *= torch.where(valid, grad, 0.0).unsqueeze(1)
        return dz, None, None, None, None, None, None


class _ShardedLogSoftmax(torch.autograd.Function):
    """``log_softmax`` over dimension ``dim`` of local pieces of a tensor sharded on it: the
    max and the sum of exponentials are all-reduced (forward), and the sum of the gradient
    (backward: ``dz = g - softmax * sum_c g``)."""

    @staticmethod
    def forward(ctx, z, dim, group):
        if z.shape[dim]:
            zmax = z.amax(dim=dim, keepdim=True)
        else:
            zmax = z.new_full(z.sum(dim=dim, keepdim=True).shape, float("-inf"))
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        shifted = z - zmax
        total = shifted.exp().sum(dim=dim, keepdim=True)
        dist.all_reduce(total, group=group)
        out = shifted - total.log()
        ctx.save_for_backward(out)
        ctx.dim, ctx.group = dim, group
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved_tensors
        total = grad.sum(dim=ctx.dim, keepdim=True)
        dist.all_reduce(total, group=ctx.group)
        return grad - out.exp() * total, None, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM of per-rank pieces of one value (each rank adds only what it owns); the
    gradient of every piece is that of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _class_dim(logits: DTensor) -> int:
    return 0 if logits.ndim == 1 else 1


def _is_class_sharded(logits: object) -> bool:
    if not isinstance(logits, DTensor) or logits.device_mesh.ndim != 1:
        return False
    return normalize(logits.placements[0], logits.ndim) == Shard(_class_dim(logits))


def vocab_parallel_cross_entropy(input: DTensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> DTensor:
    """``F.cross_entropy(input, target, ...)`` for logits sharded on the class dimension.

    Args:
        input: DTensor on a 1-D mesh, ``[N, C]``, ``[N, C, d1, ...]`` or ``[C]``, placement
            ``Shard(1)`` (``Shard(0)`` for ``[C]``); e.g. ``logits.flatten(0, 1)`` of a
            ``[B, T, V]`` ``Shard(-1)`` head output. Any class count, also not divisible.
        target: class indices (plain tensor or ``Replicate`` DTensor), shape of ``input``
            without the class dimension. Class probabilities are not supported.
        weight: per-class weights ``[C]`` (plain, replicated), not combined with smoothing.
        ignore_index, reduction, label_smoothing: as in ``F.cross_entropy``.

    Returns a ``Replicate`` DTensor (a scalar for ``"mean"``/``"sum"``). Cost: see the module
    docstring; the gradient of ``input`` keeps its ``Shard`` layout.
    """
    if weight is not None and label_smoothing:
        raise NotImplementedError("vocab_parallel_cross_entropy: weight together with "
                                  "label_smoothing is not supported; use one of them")
    target = _check_loss_args(input, target, reduction, "vocab_parallel_cross_entropy")
    mesh, cdim = input.device_mesh, _class_dim(input)
    n_classes = input.shape[cdim]
    start, _ = local_shard_range(input, cdim)
    local = input.to_local()
    compute = torch.promote_types(local.dtype, torch.float32)  # bf16/fp16 -> fp32, fp64 stays
    z = local.movedim(cdim, -1).reshape(-1, local.shape[cdim]).to(compute)
    flat_t = target.reshape(-1)
    if flat_t.shape[0] != z.shape[0]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match input shape "
                         f"{tuple(input.shape)} without its class dimension {cdim}")
    loss = _ShardedCrossEntropy.apply(z, flat_t, start, n_classes, mesh.get_group(), ignore_index,
                                      float(label_smoothing))
    return _reduced(loss, input, target, flat_t, weight, ignore_index, reduction)


def _reduced(loss: torch.Tensor, input: DTensor, target: torch.Tensor, flat_t: torch.Tensor,
             weight: torch.Tensor | None, ignore_index: int, reduction: str) -> DTensor:
    """Per-sample ``loss`` (0 where ignored) weighted and reduced as ``F.nll_loss`` does, as a
    ``Replicate`` DTensor of ``input``'s dtype on its mesh."""
    n_classes = input.shape[_class_dim(input)]
    valid = flat_t != ignore_index
    if weight is not None:
        w = weight.full_tensor() if isinstance(weight, DTensor) else weight
        w = torch.where(valid, w.to(loss.dtype)[flat_t.clamp(0, n_classes - 1)], 0.0)
        loss, count = loss * w, w.sum()
    else:
        count = valid.sum().to(loss.dtype)
    if reduction == "none":
        out = loss.reshape(target.shape)
    else:
        out = loss.sum() if reduction == "sum" else loss.sum() / count
    return DTensor.from_local(out.to(input.dtype), input.device_mesh, [Replicate()], run_check=False)


def _check_loss_args(input: object, target: torch.Tensor, reduction: str, what: str) -> torch.Tensor:
    """The target as a plain tensor of class indices; ValueError unless ``input`` is class-sharded."""
    if not _is_class_sharded(input):
        raise ValueError(_not_sharded(what, input, "input"))
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if target.is_floating_point():
        raise NotImplementedError(f"{what}: class-probability targets are not supported; pass class indices")
    return target


def _not_sharded(what: str, x: object, role: str, dim: int | None = None) -> str:
    """The ValueError text for a DTensor that is not sharded on the class dimension."""
    placements = getattr(x, "placements", "")
    ndim = getattr(getattr(x, "device_mesh", None), "ndim", "?")
    want = _class_dim(x) if dim is None and isinstance(x, DTensor) else dim
    return (f"loss_parallel: {what} got {type(x).__name__} {role} with placements {placements} on a {ndim}-D "
            f"mesh; it needs its {role} sharded on the class dimension (Shard({want}), i.e. Shard(-1) of the "
            f"[..., classes] head output flattened to [N, classes]) on a 1-D mesh: use "
            "ColwiseParallel(use_local_output=False) on the output head, or call it outside loss_parallel()")


def _sharded_log_softmax(input: DTensor, dim: int, dtype: torch.dtype | None = None) -> DTensor:
    """``F.log_softmax(input, dim)`` of a DTensor sharded on ``dim``: the result keeps that layout."""
    local = input.to_local() if dtype is None else input.to_local().to(dtype)
    compute = torch.promote_types(local.dtype, torch.float32)
    out = _ShardedLogSoftmax.apply(local.to(compute), dim, input.device_mesh.get_group()).to(local.dtype)
    return DTensor.from_local(out, input.device_mesh, input.placements, run_check=False, shape=input.shape,
                              stride=input.stride())


def _sharded_nll_loss(input: DTensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                      ignore_index: int = -100, reduction: str = "mean") -> DTensor:
    """``F.nll_loss`` of log-probabilities sharded on the class dimension (e.g. from
    ``F.log_softmax`` inside `loss_parallel`): the owner of each target class gives its
    log-probability, one all-reduce SUM of ``N`` values; the gradient stays sharded."""
    target = _check_loss_args(input, target, reduction, "F.nll_loss")
    cdim = _class_dim(input)
    start, _ = local_shard_range(input, cdim)
    local = input.to_local()
    x = local.movedim(cdim, -1).reshape(-1, local.shape[cdim]).to(torch.promote_types(local.dtype, torch.float32))
    flat_t = target.reshape(-1)
    if flat_t.shape[0] != x.shape[0]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match input shape "
                         f"{tuple(input.shape)} without its class dimension {cdim}")
    local_t = flat_t - start
    mine = (flat_t != ignore_index) & (local_t >= 0) & (local_t < x.shape[1])
    picked = x.gather(1, local_t.clamp(0, max(x.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1) if x.shape[1] \
        else x.new_zeros(x.shape[0])
    picked = _SumOverRanks.apply(torch.where(mine, picked, 0.0), input.device_mesh.get_group())
    return _reduced(-picked, input, target, flat_t, weight, ignore_index, reduction)


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.cross_entropy, F.nll_loss):
            logits = args[0] if args else kwargs.get("input")
            if isinstance(logits, DTensor):  # as torch: a DTensor here must be class-sharded
                if not _is_class_sharded(logits):
                    raise ValueError(_not_sharded(f"F.{func.__name__}", logits, "input"))
                return (_routed_cross_entropy if func is F.cross_entropy else _routed_nll_loss)(*args, **kwargs)
        elif func is F.log_softmax:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, DTensor):
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                if dim is None or x.device_mesh.ndim != 1 or \
                        normalize(x.placements[0], x.ndim) != Shard(dim % max(x.ndim, 1)):
                    raise ValueError(_not_sharded(f"F.log_softmax(dim={dim})", x, "input",
                                                  dim if dim is not None else _class_dim(x)))
                dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
                return _sharded_log_softmax(x, dim % max(x.ndim, 1), dtype)
        return func(*args, **kwargs)


def _routed_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                          reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("loss_parallel: the deprecated size_average/reduce arguments are "
                                  "not supported; use reduction=")
    return vocab_parallel_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)


def _routed_nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                     reduction="mean"):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("loss_parallel: the deprecated size_average/reduce arguments are "
                                  "not supported; use reduction=")
    return _sharded_nll_loss(input, target, weight, ignore_index, reduction)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Context manager: ``F.cross_entropy`` on class-sharded DTensor logits -> `vocab_parallel_cross_entropy`.

    Written for torch's ``loss_parallel`` users::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()

    ``F.cross_entropy`` / ``nn.CrossEntropyLoss``, ``F.log_softmax`` (the result keeps the
    sharding) and ``F.nll_loss`` are routed, as in torch; calls on plain tensors run unchanged. A
    DTensor given to them that is not sharded on the class (softmax) dimension on a 1-D mesh is
    a ``ValueError`` naming ``loss_parallel`` and the placement it needs, on every rank, as in
    torch (not DTensor's dispatch error).
    """
    with _LossParallelMode():
        yield
