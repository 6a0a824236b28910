"""Cross-entropy over class-sharded logits, without gathering the classes.

Logits ``z`` of ``C`` classes are split over ``p`` ranks (``Shard`` on the class dimension,
the output of a `ColwiseParallel` head with ``use_local_output=False``); rank ``r`` holds the
classes ``[o_r, o_r + n_r)``. For each sample with target ``y``:

    m    = max_c z_c                      all-reduce MAX of the local maxima
    S    = sum_c exp(z_c - m)             all-reduce SUM of the local sums
    z_y  = the target logit               all-reduce SUM (only its owner adds a nonzero)
    loss = log S + m - z_y                (+ label smoothing eps: (1-eps) loss
                                           + eps (log S + m - mean_c z_c), mean_c via the same SUM)

Forward: one all-reduce of ``N`` floats (MAX) and one of ``2N`` or ``3N`` floats (SUM) for
``N`` samples, instead of gathering ``N x C`` logits. Backward: no collective, rank ``r``
writes ``dz_c = g (softmax_c - (1-eps) [c = y] - eps / C)`` for its own classes.

Two entry points: the function `vocab_parallel_cross_entropy`, and the context manager
`loss_parallel` in which ``F.cross_entropy`` (and ``nn.CrossEntropyLoss``) called on such a
DTensor is routed to it (other calls are untouched). The result is a ``Replicate`` DTensor.
The backward may run inside or outside the context.
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
    if not _is_class_sharded(input):
        raise ValueError("vocab_parallel_cross_entropy: input must be a DTensor on a 1-D mesh "
                         "sharded on the class dimension (Shard(1), or Shard(0) for 1-D input), got "
                         f"{type(input).__name__} {getattr(input, 'placements', '')}; use "
                         "ColwiseParallel(use_local_output=False) on the output head")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    if weight is not None and label_smoothing:
        raise NotImplementedError("vocab_parallel_cross_entropy: weight together with "
                                  "label_smoothing is not supported; use one of them")
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if target.is_floating_point():
        raise NotImplementedError("vocab_parallel_cross_entropy: class-probability targets are "
                                  "not supported; pass class indices")
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
    return DTensor.from_local(out.to(input.dtype), mesh, [Replicate()], run_check=False)


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            logits = args[0] if args else kwargs.get("input")
            if _is_class_sharded(logits):
                return _routed_cross_entropy(*args, **kwargs)
            if isinstance(logits, DTensor):  # as torch: a DTensor here must be class-sharded
                raise ValueError(
                    f"loss_parallel: F.cross_entropy got a DTensor with placements {logits.placements} "
                    f"on a {logits.device_mesh.ndim}-D mesh; it needs logits sharded on the class "
                    f"dimension (Shard({_class_dim(logits)})) on a 1-D mesh: use "
                    "ColwiseParallel(use_local_output=False) on the output head, or call "
                    "cross_entropy outside loss_parallel()")
        return func(*args, **kwargs)


def _routed_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                          reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("loss_parallel: the deprecated size_average/reduce arguments are "
                                  "not supported; use reduction=")
    return vocab_parallel_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Context manager: ``F.cross_entropy`` on class-sharded DTensor logits -> `vocab_parallel_cross_entropy`.

    Written for torch's ``loss_parallel`` users::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()

    Only ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` are routed (not ``log_softmax`` +
    ``nll_loss``); calls on plain tensors run unchanged. A DTensor that is not class-sharded on
    a 1-D mesh is a ``ValueError`` inside the context, as in torch.
    """
    with _LossParallelMode():
        yield
