"""Small models and a reference-vs-sharded training loop shared by the multi-rank tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from tests._compare import maxerr


class Block(nn.Module):
    """Residual MLP block; hidden 7 does not divide 2 or 4 ranks."""

    def __init__(self, dim: int, hidden: int = 7) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding -> blocks -> head. ``scale`` (2 elements) is smaller than a 4-rank world and
    ``head`` has 3 rows (uneven on 2 and 4 ranks, empty shard on rank 3 of 4)."""

    def __init__(self, vocab: int = 11, dim: int = 6, n_blocks: int = 2, out: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, out)
        self.scale = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale.sum()


def make_mesh(shape: tuple[int, ...]):
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def batches(steps: int, batch: int, seq: int = 5, vocab: int = 11, out: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (batch, seq), generator=g), torch.randn(batch, seq, out, generator=g))
        for _ in range(steps)
    ]


def loss_fn(pred, target):
    return ((pred - target) ** 2).mean()


def reference_and_copy(seed: int = 0, **kw):
    torch.manual_seed(seed)
    ref = Net(**kw)
    return ref, copy.deepcopy(ref)


def train_pair(ref, model, rank: int, dp_size: int, steps: int = 3, batch: int = 8, lr: float = 1e-2, dp_rank=None,
               out: int = 3, target_dtype: torch.dtype | None = None):
    """Train ``ref`` on the whole batch and ``model`` on this rank's slice; return the max
    relative loss difference over the steps (losses averaged over the dp ranks). Targets are
    cast to ``target_dtype`` when given (models converted with ``.to(dtype)``)."""
    dp_rank = rank if dp_rank is None else dp_rank
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    worst = 0.0
    per = batch // dp_size
    for tokens, target in batches(steps, batch, out=out):
        if target_dtype is not None:
            target = target.to(target_dtype)
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        worst = maxerr(worst, step_pair(ref, ropt, model, opt, tokens, target, sl))
    return worst


def step_pair(ref, ropt, model, opt, tokens, target, sl: slice) -> float:
    """One optimizer step of ``ref`` on the whole batch and of ``model`` on this rank's rows
    ``sl``; the relative difference of the losses (``model``'s averaged over all ranks)."""
    ref_loss = loss_fn(ref(tokens), target)
    ref_loss.backward()
    ropt.step()
    ropt.zero_grad()
    loss = loss_fn(model(tokens[sl]), target[sl])
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return abs(mean.item() - ref_loss.item()) / abs(ref_loss.item())


def max_param_error(ref, model) -> dict[str, float]:
    """Relative max error of every parameter's full tensor against the reference."""
    out = {}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        r = ref_params[name].detach()
        out[name] = ((full - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
    return out
