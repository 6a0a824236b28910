"""A small Llama-style decoder written in plain torch, used by the examples and tests.

Nothing is downloaded: the model is built from a :class:`LlamaConfig` and
initialised from a seeded ``torch.Generator``, so every rank that builds it with
the same seed holds bit-identical weights before sharding.

Shape conventions: ``B`` batch, ``T`` sequence length, ``D`` model width,
``H`` query heads, ``Hkv`` key/value heads, ``Dh = D // H`` head width,
``V`` vocabulary size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "rotary_tables",
    "apply_rotary",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Llama",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of :class:`Llama`.

    ``n_kv_heads=None`` means plain multi-head attention (``n_kv_heads == n_heads``);
    a smaller divisor of ``n_heads`` gives grouped-query attention.
    ``ffn_hidden=None`` picks ``8/3 * dim`` rounded up to a multiple of 16.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head width dim // n_heads must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 16 * math.ceil(8 * self.dim / 3 / 16)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    ``RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g`` with a learned gain ``g`` (init 1).
    The statistic is computed in float32 whatever the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for rotary position embeddings, each ``[max_seq_len, head_dim // 2]``.

    Pair ``i`` of a head vector turns at frequency ``w_i = theta^(-2i / head_dim)``;
    at position ``t`` the angle is ``t * w_i``.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs ``(x[2i], x[2i+1])`` of ``x [B, T, heads, Dh]`` by ``t * w_i``.

    ``(a, b) -> (a cos - b sin, a sin + b cos)``; ``cos``/``sin`` are ``[T, Dh // 2]``.
    Dot products of rotated q and k then depend only on the relative position.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary q/k and optional grouped-query heads.

    ``q = wq x, k = wk x, v = wv x`` (no biases), rotary applied to q and k,
    ``softmax(q k^T / sqrt(Dh) + causal mask) v`` per head, then ``wo``.
    With ``Hkv < H`` each k/v head serves ``H / Hkv`` query heads.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def reset_parameters(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
        nn.init.trunc_normal_(self.wo.weight, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            groups = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        # SDPA wants [B, heads, T, Dh].
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``FFN(x) = w2(silu(w1 x) * w3 x)``, ``silu(z) = z * sigmoid(z)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def reset_parameters(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        for lin in (self.w1, self.w3):
            nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block.

    ``h = x + attention(attention_norm(x))``; ``out = h + feed_forward(ffn_norm(h))``.
    This is the unit that gets its own ``fully_shard`` call.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden)

    def reset_parameters(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters(std, out_std, generator)
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters(std, out_std, generator)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only language model: ``logits = output(norm(blocks(tok_embeddings(tokens))))``.

    ``forward(tokens [B, T] int64) -> logits [B, T, V]`` with ``T <= max_seq_len``.
    The rotary tables are non-persistent buffers on the root (not in the state
    dict); :meth:`init_weights` recomputes them, so a model built on the meta
    device can be materialised with ``to_empty`` followed by ``init_weights``.
    """

    # Same meaning as in Hugging Face models: the blocks a wrapper must not split.
    _no_split_modules = ["TransformerBlock"]

    def __init__(self, cfg: LlamaConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.output.weight.device.type != "meta":
            self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialise every parameter and the rotary buffers.

        Weights are truncated normals cut at 3 std: ``std = cfg.init_std`` for the
        embedding, the q/k/v and w1/w3 input projections and the output head, and
        ``std / sqrt(2 * n_layers)`` for the projections that write into the
        residual stream (``wo``, ``w2``); norm gains are 1. With the small default
        std the first logits are near zero, so the initial loss is about
        ``ln(vocab_size)``. Parameters are filled in a fixed order from
        ``generator`` (the global RNG if ``None``), so a generator seeded the same
        way reproduces the same model.
        """
        cfg = self.cfg
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        nn.init.trunc_normal_(self.tok_embeddings.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
        for block in self.layers:
            block.reset_parameters(std, out_std, generator)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` (int64 ``[T]``, default ``0 .. T-1``): the global position of each
        token, which the rotary tables are read at; a context-parallel rank passes those of its
        zigzag shard (``shardwise.composable.zigzag_positions``)."""
        T = tokens.shape[1]
        if position_ids is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            if position_ids.shape != (T,) or int(position_ids.max()) >= self.cfg.max_seq_len:
                raise ValueError(f"position_ids must be [T={T}] positions below max_seq_len={self.cfg.max_seq_len}, "
                                 f"got shape {tuple(position_ids.shape)}")
            cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h))

    def num_params(self) -> int:
        """Number of parameters of the full (unsharded) model."""
        return sum(p.numel() for p in self.parameters())
