"""Attention of one block of queries against one block of keys, with its log-sum-exp, and its
backward: the per-block arithmetic of both context-parallel variants.

[Note: merging blocks by log-sum-exp]
Over key blocks ``1 .. n``, ``o = sum_j exp(lse_j - lse) o_j`` with ``lse = log(sum_j
exp(lse_j))``, so blocks merge pairwise (`merge`) in any order, on any rank; a row that has seen
no key has ``lse = -inf``, ``o = 0``. The backward needs only the final ``o``, ``lse`` and ``do``:
``P = exp(S - lse)``, ``delta = rowsum(do * o)``, ``dS = P (dP - delta)``, ``dP = do V^T``.

Shapes: ``q [B, H, Tq, D]``, ``k``, ``v`` ``[B, Hkv, Tk, D]``, ``H = G * Hkv`` (query head ``h``
uses key head ``h // G``); outputs float32. On CPU torch's fused kernel (``_compat.py``; about 5x
faster at 1024 x 1024, key heads repeated for GQA); elsewhere, and with ``KERNEL = "math"``, the
float32 matmuls below, the reference the fused path is tested against.
"""

from __future__ import annotations

import torch

from ._compat import fused_available, fused_backward, fused_forward

__all__ = ["FULL", "DIAGONAL", "KERNEL", "block_forward", "block_backward", "merge"]

KERNEL = "auto"
"""``"auto"``: the fused kernel where `fused_available`, else the matmuls; ``"math"``: always
the matmuls (tests set it to compare the two)."""


def _fused(q: torch.Tensor) -> bool:
    return KERNEL == "auto" and fused_available(q)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)

FULL = "full"
"""Every query of the block sees every key."""
DIAGONAL = "diagonal"
"""Query ``i`` sees keys ``0 .. i`` (the block pairs a chunk with itself under a causal mask)."""


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, H, T, D]`` as ``[B, Hkv, G, T, D]`` (query heads grouped by their key head)."""
    B, H, T, D = q.shape
    return q.reshape(B, hkv, H // hkv, T, D)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    s = torch.matmul(_grouped(q.float(), k.shape[1]), k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if kind == DIAGONAL:
        tq, tk = s.shape[-2], s.shape[-1]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s  # [B, Hkv, G, Tq, Tk]


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, H, Tq, D], lse [B, H, Tq])`` of ``q`` against one key block (float32)."""
    if _fused(q):
        g = q.shape[1] // k.shape[1]
        o_f, lse_f = fused_forward(q, _repeat(k, g), _repeat(v, g), scale, kind == DIAGONAL)
        return o_f.float(), lse_f
    s = _scores(q, k, scale, kind)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.matmul(p, v.float().unsqueeze(2))
    return o.flatten(1, 2), lse.flatten(1, 2)


def merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` merged with a new block's ``(o_b, lse_b)`` ([Note: merging blocks by
    log-sum-exp]); ``o is None`` is the empty start."""
    if o is None or lse is None:
        return o_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows that saw nothing yet
    w_a = torch.exp(lse - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return o * w_a + o_b * w_b, new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float,
                   kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (float32) of one block, from the *final* output ``out``, ``lse [B, H, Tq]``
    and ``delta = rowsum(do * out) [B, H, Tq]`` of the queries; ``dk``/``dv`` summed over each
    key head's query group."""
    hkv = k.shape[1]
    if _fused(q):
        g = q.shape[1] // hkv
        dq_f, dk_f, dv_f = fused_backward(do, q, _repeat(k, g), _repeat(v, g), out, lse, scale, kind == DIAGONAL)
        B, _, T, D = dk_f.shape
        return dq_f.float(), dk_f.float().view(B, hkv, g, T, D).sum(2), dv_f.float().view(B, hkv, g, T, D).sum(2)
    s = _scores(q, k, scale, kind)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), hkv))  # [B, Hkv, G, Tq, Tk]
    dog = _grouped(do.float(), hkv)
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - _grouped(delta.unsqueeze(-1), hkv))
    dq = torch.matmul(ds, k.float().unsqueeze(2)).flatten(1, 2) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.float(), hkv)).sum(2) * scale
    return dq, dk, dv
