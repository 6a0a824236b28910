"""`ExpertParallel` on the `MoE` layer vs the same layer in one process: outputs, input gradients,
weight gradients, the router losses and the capacity drops, on 2 and 4 gloo ranks (fp32, 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.composable import ExpertParallel, MoE, fully_shard, parallelize_module
from shardwise.mesh import data_parallel_mesh, expert_meshes, init_mesh
from tests._dist import run_ranks

TOL = {"rtol": 1e-6, "atol": 1e-6}
# An expert's weight gradient sums the tokens of every rank: here one matmul over the tokens the
# expert received, in the reference four backward passes accumulated one after another. The
# summation order differs, so a few elements round differently (measured: 1 of 1024 at 2.7e-6
# relative, world 4, softmax-capacity, on an AMD EPYC; the earlier runs of this suite saw none).
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}
CONFIGS = {
    "softmax-top2": dict(num_experts=8, top_k=2),
    "sigmoid-shared": dict(num_experts=8, top_k=3, score_func="sigmoid", shared_hidden=12),
    "softmax-capacity": dict(num_experts=8, top_k=2, capacity_factor=1.0),
    "top1-unnormalized": dict(num_experts=4, top_k=1, norm_topk_prob=False),
}


def _batch(rank: int, tokens: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(tokens, dim, generator=g) * 2


def _loss(moe: MoE, x: torch.Tensor, rank: int) -> torch.Tensor:
    out = moe(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(200 + rank))
    assert moe.aux_loss is not None and moe.z_loss is not None
    return (out * weight).sum() + 0.1 * moe.aux_loss + 0.01 * moe.z_loss


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: dict = TOL) -> None:
    try:
        torch.testing.assert_close(a, b, **tol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _parity(rank, world, config, tokens, dim):
    torch.manual_seed(0)
    ref = MoE(dim, 16, **config)
    moe = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(moe, mesh, {"experts": ExpertParallel()})
    local = moe.experts.w1.to_local()
    assert isinstance(moe.experts.w1, DTensor) and moe.experts.w1.placements == (Shard(0),)
    assert local.shape[0] == config["num_experts"] // world, f"rank {rank} holds {local.shape[0]} experts"
    x = _batch(rank, tokens[rank], dim).requires_grad_()
    loss = _loss(moe, x, rank)
    loss.backward()
    # the reference: one process, every rank's tokens (each rank's forward on its own tokens,
    # since the router's losses and the capacity are per forward)
    ref_x, ref_out, drops = [], [], []
    for r in range(world):
        xr = _batch(r, tokens[r], dim).requires_grad_()
        _loss(ref, xr, r).backward()
        ref_x.append(xr)
        ref_out.append(ref(xr.detach()).detach())
        drops.append(ref.stats.dropped_fraction)
    with torch.no_grad():
        _close(moe(x.detach()), ref_out[rank], "output")
    assert moe.stats.dropped_fraction == drops[rank], (moe.stats.dropped_fraction, drops[rank])
    _close(x.grad, ref_x[rank].grad, "input grad")
    for name, p in moe.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        if isinstance(p, DTensor):
            assert p.grad.placements == (Shard(0),), f"{name} grad {p.grad.placements}"
            got = p.grad.full_tensor()
        else:  # dense (router, shared experts): each rank has its tokens' share
            got = p.grad.clone()
            dist.all_reduce(got)
        _close(got, want, f"{name} grad", GRAD_TOL)
    assert sum(moe.experts.dispatch_stats.received) == sum(moe.experts.dispatch_stats.per_local_expert)
    return drops


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_one_process(world, config):
    tokens = [15, 7, 1, 12][:world]  # uneven; a rank with one token (some ranks get nothing)
    drops = run_ranks(_parity, world, CONFIGS[config], tokens, 8)[0]
    if "capacity" in config:
        assert any(d > 0 for d in drops), f"the capacity test drops nothing: {drops}"


def _errors(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = []
    try:
        parallelize_module(MoE(4, 8, num_experts=6, top_k=2), mesh, {"experts": ExpertParallel()})
    except ValueError as e:
        out.append(str(e))
    try:
        parallelize_module(torch.nn.Linear(2, 2), mesh, ExpertParallel())
    except TypeError as e:
        out.append(str(e))
    whole = init_mesh(device_type="cpu", ep=2)
    moe = parallelize_module(MoE(4, 8, num_experts=4, top_k=2), expert_meshes(whole).ep, {"experts": ExpertParallel()})
    try:  # the experts need their own unit first
        fully_shard(moe, mesh=data_parallel_mesh(whole))
    except ValueError as e:
        out.append(str(e))
    return out


def test_expert_parallel_bad_input():
    msgs = run_ranks(_errors, 4)[0]
    assert "num_experts(6) is not a multiple of the ep mesh size(4)" in msgs[0]
    assert "applies to a GroupedExperts or a MoE" in msgs[1]
    assert "call shardwise.composable.fully_shard_experts(moe, expert_meshes(mesh))" in msgs[2], msgs[2]
