"""Top-k token-choice routing and the router's two auxiliary losses.

[Note: the router's losses]
For ``T`` tokens, ``E`` experts, ``k`` per token, logits ``z`` ``[T, E]`` and probabilities ``p``
(``softmax(z)``, or sigmoid scores normalized per token): the load-balancing loss (Switch's,
top-k as HF's Mixtral) ``aux = E * sum_i f_i * P_i``, ``f_i`` the fraction of tokens that chose
expert ``i`` (``sum_i f_i = k``, no gradient), ``P_i = mean_t p[t, i]``: ``k`` when uniform; and
the z-loss (ST-MoE) ``mean_t (logsumexp_e z[t, e])^2``. Both over one forward's tokens, unscaled,
before any capacity drop. The *sequence-wise* loss (DeepSeek-V3) is the same per sequence; its
mean does not depend on how sequences are grouped into forwards (microbatches, accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TopKRouter", "Routing", "load_balancing_loss", "sequence_load_balancing_loss", "router_z_loss"]

_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """One forward's routing of ``T`` tokens.

    Attributes:
        weights: ``[T, k]`` the combine weight of each chosen expert.
        experts: ``[T, k]`` int64 the chosen experts (descending score).
        probs: ``[T, E]`` the router probabilities (see [Note: the router's losses]).
        logits: ``[T, E]`` the router logits.
    """

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


class TopKRouter(nn.Module):
    """``z = gate(x)`` (``nn.Linear(dim, num_experts, bias=False)``), each token's ``top_k``
    (``1 <= top_k <= num_experts``) highest-scoring experts. ``score_func``: ``"softmax"``
    (Mixtral, Qwen-MoE) or ``"sigmoid"`` (DeepSeek-V3); ``norm_topk_prob``: divide the chosen
    scores by their sum (default True; Qwen2-MoE False); ``route_scale``: multiplies the weights
    (DeepSeek-V3's ``routed_scaling_factor``).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: bool = True, route_scale: float = 1.0) -> None:
        super().__init__()
        if score_func not in _SCORES:
            raise ValueError(f"TopKRouter(score_func={score_func!r}): use one of {_SCORES}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} must be in 1..num_experts({num_experts})")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob, self.route_scale = score_func, norm_topk_prob, route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` of shape ``[T, dim]``."""
        logits = self.gate(x)
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        top, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            top = top * self.route_scale
        return Routing(weights=top, experts=experts, probs=probs, logits=logits)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``E * sum_i f_i P_i`` (see [Note: the router's losses]); ``probs`` ``[T, E]``,
    ``experts`` ``[T, k]``."""
    num_tokens, num_experts = probs.shape
    counts = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype)
    f = counts / max(num_tokens, 1)
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(z_t)^2`` (see [Note: the router's losses]); ``logits`` ``[T, E]``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean().to(logits.dtype)


def sequence_load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """`load_balancing_loss` of each sequence on its own (see [Note: the router's losses]):
    ``probs`` ``[B, S, E]``, ``experts`` ``[B, S, k]`` -> ``[B]``."""
    batch, seq, num_experts = probs.shape
    counts = probs.new_zeros((batch, num_experts)).scatter_add_(
        1, experts.reshape(batch, -1), probs.new_ones((batch, experts[0].numel())))
    return num_experts * (counts / max(seq, 1) * probs.mean(dim=1)).sum(dim=-1)
