"""Differential: ``fully_shard(shard_placement_fn=...)`` and ``dp_mesh_dims`` on torch's FSDP2
and on shardwise, both against one process. torch 2.13 needs even splits on a nonzero dim,
so the placement function picks the largest dim that divides the shard axis (dim 0 else);
uneven nonzero dims are shardwise-only (tests/test_shard_placement.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from tests._dist import run_on_workers
from tests.compat._adapter import IMPLS, assert_close, assert_losses, batches, build, full_params, impl, reference, train

TOL = 1e-6
WORLD = 4


def _even_largest(world: int):
    def fn(p):
        dims = [d for d in range(p.dim()) if p.shape[d] % world == 0]
        return Shard(max(dims, key=lambda d: p.shape[d])) if dims else None
    return fn


def _placement(rank, world_size, name):
    i = impl(name)
    data = batches(3)
    ref, want = reference(data)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build(0)
    fn = _even_largest(world_size)
    for b in model.blocks:
        i.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
    i.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
    dims = sorted({p.placements[0].dim for p in model.parameters()})
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    assert_losses(losses, want, TOL, f"{name} shard_placement_fn")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} shard_placement_fn: parameters")
    return dims


@pytest.mark.parametrize("name", IMPLS)
def test_shard_placement_fn(name):
    dims = run_on_workers(_placement, WORLD, name)
    assert all(d == dims[0] for d in dims) and len(dims[0]) > 1, f"{name}: shard dims used {dims}"


def _spmd(rank, world_size, name):
    """dp_mesh_dims: parameters replicated on the whole (dp, tp) mesh, FSDP over dp."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    i = impl(name)
    data = batches(3)
    ref, want = reference(data)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build(0)
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    from shardwise.composable import DataParallelMeshDims as OurDims

    dims = (TorchDims if name == "torch" else OurDims)(shard="dp")
    for b in model.blocks:
        i.fully_shard(b, mesh=mesh, dp_mesh_dims=dims)
    i.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    assert_losses(losses, want, TOL, f"{name} dp_mesh_dims")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} dp_mesh_dims: parameters")
    return [tuple(type(pl).__name__ for pl in p.placements) for p in model.parameters()][:1]


@pytest.mark.parametrize("name", [
    pytest.param("torch", marks=pytest.mark.xfail(strict=True, reason=(
        "torch 2.13's dp_mesh_dims keeps the unsharded parameters as DTensors on the whole mesh: a model fed plain "
        "tensors fails with 'got mixed torch.Tensor and DTensor'"))),
    "shardwise"])
def test_dp_mesh_dims_on_a_replicated_mesh(name):
    out = run_on_workers(_spmd, WORLD, name)
    assert out[0] == [("Shard",)], f"{name}: placements {out[0]}"
