"""`GroupedExperts`: ``E`` SwiGLU experts as stacked weights, computed per expert on its tokens."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GroupedExperts", "expert_ffn", "local_weight"]


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """The experts this rank computes: the local tensor of an expert-parallel DTensor, else ``w``."""
    return w.to_local() if isinstance(w, DTensor) else w


def expert_ffn(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
               w3: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` consecutive rows for expert ``e`` of the
    stacked ``w1`` / ``w3`` ``[e, hidden, dim]`` and ``w2`` ``[e, dim, hidden]``) ->
    ``w2_e (silu(w1_e x) * w3_e x)`` per row, same order. One matmul triple per expert."""
    if len(counts) != w1.shape[0]:
        raise ValueError(f"expert_ffn: {len(counts)} token counts for {w1.shape[0]} experts")
    outs = []
    for e, rows in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
        outs.append(h @ w2[e].t())
    if not outs:
        return x.new_zeros((0, w2.shape[1]))
    return torch.cat(outs, dim=0)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts, weights stacked on dim 0: ``w1``, ``w3`` ``[E, hidden,
    dim]`` (gate, up; ``w1[e]`` as an ``nn.Linear(dim, hidden).weight``), ``w2`` ``[E, dim,
    hidden]``. ``forward(x, counts)``: rows ``[N, dim]`` sorted by expert, ``counts`` ``[E]``;
    returns ``[N, dim]`` in the same order (under `ExpertParallel`, dispatched to their ranks).
    """

    dispatch_stats: Any = None
    """Under `ExpertParallel`: the last forward's `DispatchStats` (rows sent, received, per local expert)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.dim, self.hidden, self.num_experts = dim, hidden, num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialized as ``nn.Linear`` initializes its weight (uniform, bound
        ``1 / sqrt(fan_in)``)."""
        with torch.no_grad():
            for w, fan_in in ((self.w1, self.dim), (self.w3, self.dim), (self.w2, self.hidden)):
                if w.device.type != "meta":
                    bound = 1.0 / math.sqrt(fan_in)
                    w.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return expert_ffn(x, counts.tolist(), local_weight(self.w1), local_weight(self.w2), local_weight(self.w3))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}"
