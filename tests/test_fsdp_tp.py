"""fully_shard composed with tensor parallelism (2-D dp x tp, 3-D replicate x shard x tp):
full_tensor() of every parameter and training match a single-process model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardwise.composable import fully_shard
from shardwise.mesh import data_parallel_mesh, init_mesh
from tests._compare import maxerr
from tests._dist import run_ranks

TOL = 1e-6


class MLP(nn.Module):
    def __init__(self, dim=6, hidden=8):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim=6, hidden=8, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim, hidden) for _ in range(n))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _torch_tp(model, tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _fsdp_tp(rank, world_size, shape, hidden, steps):
    dp_replicate, dp_shard, tp = shape
    mesh = init_mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, device_type="cpu")
    dp_mesh = data_parallel_mesh(mesh)
    torch.manual_seed(0)
    ref = Stack(hidden=hidden)
    model = copy.deepcopy(ref)
    _torch_tp(model, mesh["tp"])
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), n
        assert torch.equal(p.full_tensor(), dict(ref.named_parameters())[n].detach()), f"{n}: full_tensor at init"
    dp_size = dp_replicate * dp_shard
    coord = mesh.get_coordinate()
    dp_rank = coord[0] * dp_shard + coord[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(steps):
        x, y = torch.randn(8, 5, 6, generator=g), torch.randn(8, 5, 3, generator=g)
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        ropt.step()
        ropt.zero_grad()
        per = 8 // dp_size
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = ((model(x[sl]) - y[sl]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        worst = max(worst, abs(mean.item() - ref_loss.item()) / ref_loss.item())
    errs = {n: ((p.full_tensor() - r).abs().max() / r.abs().max()).item()
            for (n, p), r in zip(model.named_parameters(), ref.parameters())}
    placements = {n: tuple(str(x) for x in p.placements) for n, p in model.named_parameters()}
    return worst, errs, placements


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2)], ids=["dp2xtp2", "rep2xtp2"])
def test_fully_shard_on_torch_tensor_parallel_parameters(shape):
    for rank, (loss_err, errs, placements) in enumerate(run_ranks(_fsdp_tp, 4, shape, 8, 3, timeout=120)):
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
    up = placements["blocks.0.up.weight"]
    assert up[-2:] == ("_S(0, 2)", "S(0)"), f"colwise: dp axis strided over the TP chunks: {up}"
    assert placements["blocks.0.down.weight"][-2:] == ("S(0)", "S(1)"), placements["blocks.0.down.weight"]
