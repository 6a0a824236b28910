"""EP x FSDP (x HSDP) training steps vs one process: experts under `ExpertParallel` and
`fully_shard_experts`, dense weights under ``fully_shard`` on the whole data-parallel mesh; one
reduce-scatter per unit per step; ``clip_grad_norm_`` across the expert and dense meshes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise.composable._fsdp._reduce as reduce_mod  # spied on: the reduce-scatters a step issues
from shardwise.composable import ExpertParallel, MoE, clip_grad_norm_, fully_shard, fully_shard_experts, parallelize_module
from shardwise.mesh import data_parallel_mesh, expert_meshes, init_mesh
from tests._dist import run_ranks

TOL = {"rtol": 1e-6, "atol": 1e-6}
AUX = 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = MoE(8, 12, num_experts=8, top_k=2, shared_hidden=6)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.tanh(self.inp(x))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 4, generator=g)


def _rank_loss(model: Net, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return F.mse_loss(model(x), y) + AUX * model.moe.aux_loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(rank, world, dp_replicate, ep, steps, max_norm):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = init_mesh(device_type="cpu", dp_replicate=dp_replicate, ep=ep)
    em = expert_meshes(mesh)
    parallelize_module(model, em.ep, {"moe.experts": ExpertParallel()})
    fully_shard_experts(model.moe, em)
    fully_shard(model, mesh=data_parallel_mesh(mesh))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    calls = [0]
    real = reduce_mod.reduce_scatter_single

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    losses, norms, rs = [], [], []
    for step in range(steps):
        calls[0] = 0
        reduce_mod.reduce_scatter_single = counting
        try:
            loss = _rank_loss(model, step, rank)
            loss.backward()
        finally:
            reduce_mod.reduce_scatter_single = real
        rs.append(calls[0])
        norm = clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        # one process: the mean of every rank's loss on its own batch
        ref_loss = sum(_rank_loss(ref, step, r) for r in range(world)) / world
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((mean.item() / world, ref_loss.item()))
        norms.append((norm.item(), ref_norm.item()))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        try:
            torch.testing.assert_close(_full(p.detach()), q.detach(), **TOL)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} {name} after {steps} steps: {e}") from None
    return losses, norms, rs


@pytest.mark.parametrize("dp_replicate,ep", [(1, 2), (1, 4), (2, 2)], ids=["fsdp4-ep2", "ep4", "hsdp2x2-ep2"])
def test_ep_fsdp_training_matches_one_process(dp_replicate, ep):
    out = run_ranks(_train, 4, dp_replicate, ep, 3, 0.05)
    losses, norms, rs = out[0]
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-6), losses
    for got, want in norms:
        assert got == pytest.approx(want, rel=1e-6), norms
        assert want > 0.05, "the norm clips (max_norm below it)"
    # one per unit (experts, root) per step; a unit on a 1-rank shard axis has none to issue
    # (dp_shard_mod_ep = 4 / dp_replicate / ep)
    want = 1 + (4 // dp_replicate // ep > 1)
    assert all(r == want for r in rs), f"one reduce-scatter per unit per step: {rs}, want {want}"
