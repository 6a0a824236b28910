"""`MoE`: a mixture-of-experts feed-forward layer (router, routed experts, optional shared experts).

[Note: the order of the routed rows]
The ``T k`` assignments, token-major (``t * k + slot``), are stably sorted by expert (``order``):
row ``i`` is token ``order[i] // k``; ``inverse = argsort(order)`` puts the experts' rows back and
a token's output is the weighted sum over its slots. `ExpertParallel` sends the same sorted rows
and returns them in the same order, so the layer cannot tell local from sharded experts.

[Note: capacity]
With ``capacity_factor=c`` each expert takes the first ``C = ceil(c * T * k / E)`` of this
forward's assignments in token order; the rest add nothing (weights not renormalized; shared
experts still see every token). Under EP ``T`` is the rank's own tokens. ``stats.dropped_fraction``
is the dropped share; ``None`` (default) is dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._experts import GroupedExperts
from ._router import TopKRouter, load_balancing_loss, router_z_loss, sequence_load_balancing_loss

__all__ = ["MoE", "MoEStats", "SharedExperts"]


@dataclass(frozen=True)
class MoEStats:
    """What one forward of a `MoE` did: ``tokens_per_expert`` (int64 ``[E]``, assignments before
    capacity drops, this rank's tokens) and ``dropped_fraction`` (of the ``T k`` assignments)."""

    tokens_per_expert: torch.Tensor
    dropped_fraction: float


class SharedExperts(nn.Module):
    """A dense SwiGLU MLP every token goes through (DeepSeek / Qwen-MoE shared experts):
    ``down(silu(gate x) * up x)``, hidden size = shared experts x their hidden size."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: ``y = sum_{e in topk(x)} w_e expert_e(x) [+ shared(x)]``.

    Args:
        dim, hidden: model width, each routed expert's hidden width.
        num_experts, top_k, score_func, norm_topk_prob, route_scale: the router's (`TopKRouter`).
        shared_hidden: the shared experts' hidden width (`SharedExperts`); 0: none.
        shared_gate: scale the shared output by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).
        capacity_factor: None (dropless) or a positive float ([Note: capacity]).

    ``forward(x)``: ``[..., dim]`` to the same shape; then ``aux_loss``, ``z_loss`` (tensors with
    gradients: [Note: the router's losses] in `_router.py`), ``seq_aux_loss`` (per sequence; None
    for 2-D ``x``) and ``stats`` (`MoEStats`). Submodules ``router``, ``experts``, ``shared_experts``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0, shared_hidden: int = 0,
                 shared_gate: bool = False, capacity_factor: float | None = None) -> None:
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE(capacity_factor={capacity_factor!r}): use a positive float, or None for dropless")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = TopKRouter(dim, num_experts, top_k, score_func=score_func, norm_topk_prob=norm_topk_prob,
                                 route_scale=route_scale)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_experts = SharedExperts(dim, shared_hidden) if shared_hidden else None
        if shared_gate and not shared_hidden:
            raise ValueError("MoE(shared_gate=True) gates the shared experts: give shared_hidden > 0 too")
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.aux_loss: torch.Tensor | None = None
        self.seq_aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        num_tokens, k, num_experts = tokens.shape[0], self.top_k, self.num_experts
        routing = self.router(tokens)
        self.aux_loss = load_balancing_loss(routing.probs, routing.experts)
        self.seq_aux_loss = None if len(shape) < 3 else sequence_load_balancing_loss(
            routing.probs.view(-1, shape[-2], num_experts), routing.experts.view(-1, shape[-2], k)).view(shape[:-2])
        self.z_loss = router_z_loss(routing.logits)
        flat = routing.experts.flatten()  # [T k], token-major; see [Note: the order of the routed rows]
        counts = torch.bincount(flat, minlength=num_experts)
        order = torch.argsort(flat, stable=True)
        weights = routing.weights.flatten()
        dropped = 0
        if self.capacity_factor is not None:
            keep = _within_capacity(flat[order], counts, math.ceil(self.capacity_factor * num_tokens * k / num_experts))
            dropped = int(order.numel() - keep.sum().item())
            order = order[keep]
            kept = torch.bincount(flat[order], minlength=num_experts)
        else:
            kept = counts
        self.stats = MoEStats(tokens_per_expert=counts.detach(), dropped_fraction=dropped / max(flat.numel(), 1))
        rows = self.experts(tokens[order // k], kept)  # [kept, dim], sorted by expert
        contrib = rows * weights[order].unsqueeze(-1).to(rows.dtype)
        # back to token-major slots (unique indices: deterministic), then the sum over the k slots
        slots = contrib.new_zeros((num_tokens * k, shape[-1])).index_copy(0, order, contrib)
        out = slots.view(num_tokens, k, shape[-1]).sum(dim=1)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}")


def _within_capacity(sorted_experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Mask over assignments sorted by expert: True for the first ``capacity`` of each expert."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(sorted_experts.numel(), device=sorted_experts.device) - starts[sorted_experts]
    return position < capacity
