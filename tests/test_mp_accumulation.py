"""Gradient accumulation under bf16 parameters and an fp32 reduction: the unsharded gradients of
backwards that do not reduce are summed in fp32 ([Note: accumulating in the reduce dtype] in
``composable/_fsdp/_sharded_param.py``), as torch's FSDP2 does. Differential: the same accumulation on
torch's FSDP2 and on shardwise gives the same gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests._dist import run_ranks


def _net():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)], nn.Linear(32, 1))


def _accumulate(rank, world_size, impl, micro):
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from shardwise.composable import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    model = copy.deepcopy(_net())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model[:3]:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    g = torch.Generator().manual_seed(1 + rank)
    for i in range(micro):
        model.set_requires_gradient_sync(i == micro - 1)
        x = torch.randn(16, 32, generator=g)
        model(x).float().pow(2).mean().backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("micro", [8])
def test_bf16_accumulation_sums_in_fp32_like_fsdp2(micro):
    ours = run_ranks(_accumulate, 2, "shardwise", micro, timeout=60)[0]
    theirs = run_ranks(_accumulate, 2, "torch", micro, timeout=60)[0]
    for n, t in theirs.items():
        err = ((ours[n] - t).abs().max() / t.abs().max()).item()
        assert err <= 1e-6, f"{n}: shardwise vs FSDP2 relative difference {err:.2e}"
