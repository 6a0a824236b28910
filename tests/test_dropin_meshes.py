"""Several meshes in one process: models built one after another (a second model, an evaluation
job, a test process reused), each on a NEW mesh equal to or different from the last, train like
one process. Meshes are compared by value (rank layout, axis names), never by identity."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardwise.composable import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
from shardwise.composable._mesh_utils import same_mesh
from tests._dist import run_ranks

TOL = 1e-6  # fp32, relative


class MLP(nn.Module):
    def __init__(self, dim=6, hidden=8):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Only the blocks are tensor-parallel; ``emb``/``out`` are sharded over dp only."""

    def __init__(self, dim=6, hidden=8, n=2):
        super().__init__()
        self.emb = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(MLP(dim, hidden) for _ in range(n))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _tp(model, tp_mesh, impl):
    if impl == "torch":
        from torch.distributed.tensor import parallel as tp

        col, row, par = tp.ColwiseParallel, tp.RowwiseParallel, tp.parallelize_module
    else:
        col, row, par = ColwiseParallel, RowwiseParallel, parallelize_module
    for b in model.blocks:
        par(b, tp_mesh, {"up": col(), "down": row()})


def _build(kind, world, impl, seed):
    """(reference, sharded model, dp size, dp rank) on a freshly built mesh."""
    torch.manual_seed(seed)
    ref = Stack()
    model = copy.deepcopy(ref)
    if kind == "1d":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        _tp(model, mesh["tp"], impl)
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return ref, model, dp_mesh.size(), dp_mesh.get_local_rank()


def _train(ref, model, dp_size, dp_rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    per = 8 // dp_size
    for _ in range(steps):
        x, y = torch.randn(8, 5, 4, generator=g), torch.randn(8, 5, 3, generator=g)
        rl = ((ref(x) - y) ** 2).mean()
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = ((model(x[sl]) - y[sl]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / dist.get_world_size() - rl.item()) / abs(rl.item()))
    want = dict(ref.named_parameters())
    perr = max(((p.full_tensor() - want[n]).abs().max() / want[n].abs().max()).item()
               for n, p in model.named_parameters())
    return worst, perr


def _sequence(rank, world, kinds, impl):
    out = []
    for i, kind in enumerate(kinds):
        ref, model, dp_size, dp_rank = _build(kind, world, impl, seed=i)
        assert all(isinstance(p, DTensor) for p in model.parameters()), \
            f"{kind}: plain parameters left after sharding: {[n for n, p in model.named_parameters() if not isinstance(p, DTensor)]}"
        out.append(_train(ref, model, dp_size, dp_rank))
    return out


@pytest.mark.parametrize("impl", ["shardwise", "torch"])
def test_two_meshes_in_one_process_both_orders(impl):
    """One process reused across four models: 1-D, then 2-D, then a NEW equal 2-D, then 1-D."""
    results = run_ranks(_sequence, 4, ("1d", "2d", "2d", "1d"), impl, timeout=120)
    for rank, per_model in enumerate(results):
        for i, (lerr, perr) in enumerate(per_model):
            assert lerr <= TOL and perr <= 2e-6, f"rank {rank} model {i}: loss {lerr:.2e} param {perr:.2e}"
    # 2e-6 on parameters: as tests/test_fsdp_tp.py, the TP partial sums add in another order


def _torch_fsdp2(rank, world, kinds):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import parallel as tp

    out = []
    for i, kind in enumerate(kinds):
        torch.manual_seed(i)
        ref = Stack()
        model = copy.deepcopy(ref)
        if kind == "1d":
            dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            for b in model.blocks:
                tp.parallelize_module(b, mesh["tp"], {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
        for b in model.blocks:
            torch_fully_shard(b, mesh=dp_mesh)
        torch_fully_shard(model, mesh=dp_mesh)
        out.append(_train(ref, model, dp_mesh.size(), dp_mesh.get_local_rank()))
    return out


def test_torch_fsdp2_accepts_the_same_sequence():
    """The oracle: torch's FSDP2 + TP runs the same four models in one process."""
    for rank, per_model in enumerate(run_ranks(_torch_fsdp2, 4, ("1d", "2d", "2d", "1d"), timeout=120)):
        for i, (lerr, perr) in enumerate(per_model):
            assert lerr <= TOL and perr <= 2e-6, f"rank {rank} model {i}: loss {lerr:.2e} param {perr:.2e}"


def _mesh_values(rank, world):
    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    c = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "tp"))
    d = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    return [same_mesh(a, b), same_mesh(a["tp"], b["tp"]), same_mesh(a, c), same_mesh(a["dp"], d),
            same_mesh(a["tp"], c["tp"])]


def test_same_mesh_compares_layout_and_names():
    for got in run_ranks(_mesh_values, 4):
        assert got == [True, True, False, False, True], got
