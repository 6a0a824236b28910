"""Checkpoints of an expert-parallel model are by the unsplit names: ``moe.experts.w1`` is the
whole ``[E, hidden, dim]`` stack whatever the ep degree. Saved from EP 2 x FSDP on 4 ranks (model
+ AdamW state), loaded bit-exact at ep 4, at ep 2 without FSDP, and into one plain process."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.nn.functional as F

from shardwise.checkpoint import load, save, set_optimizer_state_dict
from shardwise.composable import ExpertParallel, fully_shard, fully_shard_experts, parallelize_module
from shardwise.mesh import data_parallel_mesh, expert_meshes, init_mesh
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, full
from tests.test_ep_fsdp import Net, _batch


def _build(ep: int, fsdp: bool, seed: int):
    torch.manual_seed(seed)
    model = Net()
    if ep > 1:
        mesh = init_mesh(device_type="cpu", ep=ep)
        em = expert_meshes(mesh)
        parallelize_module(model, em.ep, {"moe.experts": ExpertParallel()})
        if fsdp:
            fully_shard_experts(model.moe, em)
            fully_shard(model, mesh=data_parallel_mesh(mesh))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save(rank, world, path):
    model, optim = _build(2, True, seed=0)
    x, y = _batch(0, rank)
    (F.mse_loss(model(x), y) + 0.01 * model.moe.aux_loss).backward()
    optim.step()
    state = app_state(model, optim, step=1)
    save(state, path)
    shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    return full(state), shapes


def _load(rank, world, path, ep, fsdp):
    model, optim = _build(ep, fsdp, seed=3)
    state = app_state(model, optim)
    load(state, path)
    set_optimizer_state_dict(model, optim, state["optim"])
    return full(app_state(model, optim, step=state["trainer"]["step"]))


def test_ep_checkpoint_loads_at_other_degrees_and_plain(tmp_path):
    path = str(tmp_path / "ep")
    want, shapes = run_ranks(_save, 4, path, timeout=90)[0]
    assert shapes["moe.experts.w1"] == (8, 12, 8) and shapes["moe.experts.w2"] == (8, 8, 12), shapes
    for ep, fsdp, world in ((4, True, 4), (2, False, 2), (1, False, 1)):
        for rank, got in enumerate(run_ranks(_load, world, path, ep, fsdp, timeout=90)):
            assert_equal_states(got, want, f"EP2 x FSDP -> ep={ep} fsdp={fsdp}, rank {rank}")
