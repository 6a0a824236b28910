"""`context_parallel_attention`: scaled dot-product attention of a sequence sharded over the cp
ranks in the zigzag layout ([Note: the zigzag layout] in ``_layout.py``): each rank gets the
rows one-process SDPA gives for its own queries.

``method="ring"``: ``cp`` steps; at step ``i`` the rank attends to cp rank ``r - i``'s key/value
block while the next is on its way. Backward runs the same ring, each block travelling with its
gradient accumulator that every rank adds to, back at its owner after ``cp`` steps.
``method="allgather"``: one all-gather of the keys and values (again in backward) and one
reduce-scatter of their float32 gradients: fewer, larger messages. Per block: `block_forward` /
`block_backward` (``_block.py``); which blocks are needed under a causal mask: `block_plan`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .._mesh_utils import all_gather_single, reduce_scatter_single
from ._block import DIAGONAL, FULL, block_backward, block_forward, merge
from ._layout import Selection, block_plan, zigzag_chunks
from ._ring import InFlight, Ring

__all__ = ["METHODS", "context_parallel_attention"]

METHODS = ("ring", "allgather")
_KV_TAG, _GRAD_TAG = 7301, 7302


def _half(sel: Selection, n: int) -> slice:
    return slice(0, 2 * n) if sel is None else slice(sel * n, (sel + 1) * n)


def _forward_block(q, kv, q_ids, kv_ids, causal, scale, o, lse) -> None:
    n = q.shape[2] // 2
    for qs, ks, diag in block_plan(q_ids, kv_ids, causal):
        qsl, ksl = _half(qs, n), _half(ks, n)
        ob, lb = block_forward(q[:, :, qsl], kv[0][:, :, ksl], kv[1][:, :, ksl], scale, DIAGONAL if diag else FULL)
        o[:, :, qsl], lse[:, :, qsl] = merge(o[:, :, qsl], lse[:, :, qsl], ob, lb)


def _backward_block(q, kv, do, out, lse, delta, q_ids, kv_ids, causal, scale, dq, dkv) -> None:
    n = q.shape[2] // 2
    for qs, ks, diag in block_plan(q_ids, kv_ids, causal):
        qsl, ksl = _half(qs, n), _half(ks, n)
        dqb, dkb, dvb = block_backward(q[:, :, qsl], kv[0][:, :, ksl], kv[1][:, :, ksl], do[:, :, qsl],
                                       out[:, :, qsl], lse[:, :, qsl], delta[:, :, qsl], scale,
                                       DIAGONAL if diag else FULL)
        dq[:, :, qsl] += dqb
        dkv[0][:, :, ksl] += dkb
        dkv[1][:, :, ksl] += dvb


def _gather(kv: torch.Tensor, group, size: int) -> torch.Tensor:
    out = torch.empty(size * kv.numel(), dtype=kv.dtype, device=kv.device)
    all_gather_single(out, kv.contiguous().view(-1), group=group)
    return out.view(size, *kv.shape)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                scale: float, method: str) -> torch.Tensor:
        ring = Ring(group)
        q_ids = zigzag_chunks(ring.rank, ring.size)
        B, H, T, D = q.shape
        o = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        if method == "ring":
            for i in range(ring.size):
                nxt = ring.exchange(kv, _KV_TAG) if i < ring.size - 1 else None
                _forward_block(q, kv, q_ids, zigzag_chunks(ring.source(i), ring.size), causal, scale, o, lse)
                if nxt is not None:
                    kv = nxt.wait()
        else:
            every = _gather(kv, group, ring.size) if ring.size > 1 else kv.unsqueeze(0)
            for s in range(ring.size):
                _forward_block(q, every[s], q_ids, zigzag_chunks(s, ring.size), causal, scale, o, lse)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.method = group, causal, scale, method
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        (do,) = grads
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        q_ids = zigzag_chunks(ring.rank, ring.size)
        delta = (do.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        grad_shape = (2, *k.shape)
        args = (ctx.causal, ctx.scale)
        if ctx.method == "ring":
            passed: InFlight | None = None
            for i in range(ring.size):
                nxt = ring.exchange(kv, _KV_TAG) if i < ring.size - 1 else None
                dkv = torch.zeros(grad_shape, dtype=torch.float32, device=k.device)
                _backward_block(q, kv, do, out, lse, delta, q_ids, zigzag_chunks(ring.source(i), ring.size), *args,
                                dq, dkv)
                if passed is not None:
                    dkv += passed.wait()  # the accumulator of this block from the ranks before
                if ring.size > 1:
                    passed = ring.exchange(dkv, _GRAD_TAG)
                if nxt is not None:
                    kv = nxt.wait()
            own = passed.wait() if passed is not None else dkv
        else:
            every = _gather(kv, ctx.group, ring.size) if ring.size > 1 else kv.unsqueeze(0)
            dall = torch.zeros((ring.size, *grad_shape), dtype=torch.float32, device=k.device)
            for s in range(ring.size):
                _backward_block(q, every[s], do, out, lse, delta, q_ids, zigzag_chunks(s, ring.size), *args, dq, dall[s])
            if ring.size > 1:
                own = torch.empty(grad_shape, dtype=torch.float32, device=k.device)
                reduce_scatter_single(own.view(-1), dall.view(-1), group=ctx.group)
            else:
                own = dall[0]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | None = None, *, is_causal: bool = False,
                               scale: float | None = None, method: str = "ring") -> torch.Tensor:
    """Attention of this cp rank's queries against the whole (cp-sharded) sequence; a collective.

    Args:
        q: ``[B, H, T_local, D]``, this rank's zigzag shard (``T_local = T / cp``, two chunks).
        k, v: ``[B, Hkv, T_local, D]``; ``H`` a multiple of ``Hkv`` (SDPA's ``enable_gqa``).
        group: the cp process group; None: the default group.
        is_causal, scale: SDPA's, for the *global* sequence.
        method: ``"ring"`` (default) or ``"allgather"``.

    Returns ``[B, H, T_local, D]`` in ``q``'s dtype (computed in float32), differentiable.
    """
    if method not in METHODS:
        raise ValueError(f"context_parallel_attention: method={method!r}; use one of {METHODS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"context_parallel_attention: {name} must be a 4-D [B, heads, T_local, D] tensor, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"context_parallel_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
                         "must share batch, length and head width, and k, v the same shape")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"context_parallel_attention: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} key/value heads")
    if q.shape[2] % 2:
        raise ValueError(f"context_parallel_attention: the local length {q.shape[2]} is odd; a zigzag shard holds "
                         "two equal chunks (shard the sequence with shard_sequence, length a multiple of 2 * cp)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out: torch.Tensor = _CPAttention.apply(q, k, v, group, bool(is_causal), scale, method)
    return out
