"""Two inputs torch's `fully_shard` refuses and shardwise's takes (found by rerunning torch's own
``test_fully_shard_init.py``, docs/clients.md "torch's own unit tests"): a 2-D mesh without dim
names (torch: ``AssertionError`` "Please init the 2D mesh for HSDP with mesh_dim_names
specified"; shardwise: HSDP, ``(Replicate(), Shard(0))``) and a ``channels_last`` (non-contiguous)
``Conv2d`` weight (torch: ``NotImplementedError`` "FSDP does not support non-contiguous
parameters"). A relaxation is only acceptable if it is exact: each is trained 2 SGD steps and
compared bit for bit with one process; torch's refusal is checked too, so that the day torch
accepts them this test says so.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests._dist import run_ranks


def _train_against_one_process(model: nn.Module, shard, x: torch.Tensor) -> float:
    ref = copy.deepcopy(model)
    shard(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    return max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))


def _refusals_and_exactness(rank, world_size):
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise.composable as sw

    def conv():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    unnamed_2d = init_device_mesh("cpu", (2, world_size // 2))
    flat = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, build, mesh in (("unnamed_2d_mesh", mlp, unnamed_2d), ("channels_last_conv", conv, flat)):
        try:
            torch_fsdp.fully_shard(build(), mesh=mesh)
            out[f"torch:{name}"] = "accepted"
        except (AssertionError, NotImplementedError) as e:
            out[f"torch:{name}"] = type(e).__name__
    x_conv = torch.randn(2, 8, 9, 9, generator=torch.Generator().manual_seed(1)).to(memory_format=torch.channels_last)
    x_mlp = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    hsdp = mlp()
    out["unnamed_2d_mesh"] = _train_against_one_process(hsdp, lambda m: sw.fully_shard(m, mesh=unnamed_2d), x_mlp)
    out["placements"] = sorted({str(tuple(p.placements)) for p in hsdp.parameters()})
    out["channels_last_conv"] = _train_against_one_process(conv(), lambda m: sw.fully_shard(m, mesh=flat), x_conv)
    return out


def test_unnamed_2d_mesh_and_channels_last_conv_train_exactly():
    for rank, got in enumerate(run_ranks(_refusals_and_exactness, 4, timeout=300)):
        assert got["torch:unnamed_2d_mesh"] == "AssertionError" and \
            got["torch:channels_last_conv"] == "NotImplementedError", f"rank {rank}: torch's answers changed: {got}"
        assert got["placements"] == ["(Replicate(), Shard(dim=0))"], f"rank {rank}: {got['placements']}"
        assert got["unnamed_2d_mesh"] == 0.0 and got["channels_last_conv"] == 0.0, \
            f"rank {rank}: not bit-exact against one process: {got}"
