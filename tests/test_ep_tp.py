"""EP x TP with the experts' own weights split over ``tp`` (`ExpertTensorParallel`), x FSDP, on 4
ranks against one process: losses, clipped norms and weights after 3 steps to 1e-6 (fp32), one
reduce-scatter per unit per step; checkpoints saved under ep x tp load bit-exact at another ep /
tp and into one plain process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.distributed as dist
from torch.distributed.tensor import Shard

import shardwise.composable._fsdp._reduce as reduce_mod  # spied on: the reduce-scatters a step issues
from shardwise.checkpoint import load, save, set_optimizer_state_dict
from shardwise.composable import (ExpertParallel, ExpertTensorParallel, clip_grad_norm_, expert_parallel_plan,
                                  fully_shard, fully_shard_experts, parallelize_module, swap_hf_moe_blocks)
from shardwise.mesh import data_parallel_mesh, expert_meshes, init_mesh
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, full
from tests.test_ep_fsdp import Net, _full, _rank_loss

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _build(ep: int, tp: int, seed: int, fsdp: bool = True):
    """Net with its experts under ExpertTensorParallel on (ep, tp) (ExpertParallel when tp is 1,
    nothing on one rank), the rest replicated over tp and fully_shard-ed over dp."""
    torch.manual_seed(seed)
    model = Net()
    ref = copy.deepcopy(model)
    world = dist.get_world_size()
    if world == 1:
        return model, ref, None
    mesh = init_mesh(device_type="cpu", tp=tp)
    em = expert_meshes(mesh, ep=ep)
    style = ExpertTensorParallel(em.ep_tp) if tp > 1 else ExpertParallel()
    parallelize_module(model, em.ep, {"moe.experts": style})
    if fsdp:
        fully_shard_experts(model.moe, em)
        fully_shard(model, mesh=data_parallel_mesh(mesh))
    return model, ref, mesh


def _train(rank, world, ep, tp, steps, max_norm):
    model, ref, mesh = _build(ep, tp, seed=0)
    dp_rank, dp = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    calls, real = [0], reduce_mod.reduce_scatter_single

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    out = []
    for step in range(steps):
        calls[0] = 0
        reduce_mod.reduce_scatter_single = counting
        try:
            loss = _rank_loss(model, step, dp_rank)  # the tp ranks of one dp rank: the same batch
            loss.backward()
        finally:
            reduce_mod.reduce_scatter_single = real
        norm = clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp_shard"].get_group())
        ref_loss = sum(_rank_loss(ref, step, r) for r in range(dp)) / dp
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        out.append((mean.item() / dp, ref_loss.item(), norm.item(), ref_norm.item(), calls[0]))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        try:
            torch.testing.assert_close(_full(p.detach()), q.detach(), **TOL)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} {name} after {steps} steps: {e}") from None
    return out


@pytest.mark.parametrize("ep,tp", [(2, 2), (1, 2)], ids=["ep2xtp2", "ep1xtp2xfsdp2"])
def test_ep_tp_training_matches_one_process(ep, tp):
    steps = run_ranks(_train, 4, ep, tp, 3, 0.05, timeout=90)[0]
    for got, want, norm, ref_norm, _ in steps:
        assert got == pytest.approx(want, rel=1e-6), steps
        assert norm == pytest.approx(ref_norm, rel=1e-6), steps
        assert ref_norm > 0.05, "the norm clips (max_norm below it)"
    # units: the experts (on dp_shard_mod_ep = 2 / ep ranks: none to issue on one) and the root
    want = 1 + (2 // ep > 1)
    assert all(s[-1] == want for s in steps), f"one reduce-scatter per unit per step: {steps}, want {want}"


def _placements(rank, world):
    model, _, _ = _build(2, 2, seed=0, fsdp=False)
    e = model.moe.experts
    return [tuple(getattr(e, n).placements) for n in ("w1", "w2", "w3")], tuple(e.w1.to_local().shape)


def test_ep_tp_splits_each_expert_column_and_row_wise():
    placements, shape = run_ranks(_placements, 4)[0]
    assert placements == [(Shard(0), Shard(1)), (Shard(0), Shard(2)), (Shard(0), Shard(1))], placements
    assert shape == (4, 6, 8), shape


def _save(rank, world, path):
    model, _, mesh = _build(2, 2, seed=0)
    (_rank_loss(model, 0, mesh["dp_shard"].get_local_rank())).backward()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optim.step()
    state = app_state(model, optim, step=1)
    save(state, path)
    return full(state)


def _load(rank, world, path, ep, tp):
    model, _, _ = _build(ep, tp, seed=3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = app_state(model, optim)
    load(state, path)
    set_optimizer_state_dict(model, optim, state["optim"])
    return full(app_state(model, optim, step=state["trainer"]["step"]))


def test_ep_tp_checkpoint_loads_at_other_ep_tp_and_plain(tmp_path):
    path = str(tmp_path / "eptp")
    want = run_ranks(_save, 4, path, timeout=90)[0]
    for ep, tp, world in ((1, 2, 4), (2, 1, 2), (1, 1, 1)):
        for rank, got in enumerate(run_ranks(_load, world, path, ep, tp, timeout=90)):
            assert_equal_states(got, want, f"ep2 x tp2 -> ep={ep} tp={tp} on {world}, rank {rank}")


def _hf_etp(rank, world):
    from tests.test_ep_hf import _loss, _model, _tokens

    hf = _model("qwen2_moe")  # with its gated shared expert (computed whole on every tp rank)
    model = copy.deepcopy(hf)
    swap_hf_moe_blocks(model)
    mesh = init_mesh(device_type="cpu", tp=2)
    em = expert_meshes(mesh, ep=world // 2)
    parallelize_module(model, em.ep, expert_parallel_plan(model, em.ep_tp))
    dp_rank = mesh["dp_shard"].get_local_rank()
    logits, loss = _loss(model, _tokens(dp_rank))
    loss.backward()
    ref_logits, ref_loss = _loss(hf, _tokens(dp_rank))
    ref_loss.backward()  # this dp rank's batch only: the expert gradients are summed over the 2 dp ranks
    torch.testing.assert_close(logits, ref_logits, **TOL)
    moe, block = model.model.layers[1].mlp, hf.model.layers[1].mlp
    assert moe.experts.w1.placements == (Shard(0), Shard(1))
    grads = [moe.experts.w1.grad.full_tensor(), block.experts.gate_up_proj.grad[:, :moe.experts.hidden].clone()]
    dist.all_reduce(grads[1], group=mesh["dp_shard"].get_group())
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    return True


def test_hf_qwen2_moe_under_expert_tensor_parallel_matches_hf():
    assert run_ranks(_hf_etp, 2, timeout=120) == [True] * 2  # tp 2 (ep 1): 4 ranks cost 15 s here


def _refusals(rank, world):
    from shardwise.composable import MoE

    mesh = init_mesh(device_type="cpu", tp=2)
    em = expert_meshes(mesh, ep=1)
    with pytest.raises(ValueError, match=r"hidden\(5\) is not a multiple of tp\(2\)"):
        parallelize_module(MoE(4, 5, num_experts=2, top_k=1), em.ep, ExpertTensorParallel(em.ep_tp))
    moe = MoE(4, 6, num_experts=2, top_k=1)
    with pytest.raises(ValueError, match="not the 'ep' slice"):
        parallelize_module(moe, mesh["tp"], ExpertTensorParallel(em.ep_tp))
    with pytest.raises(ValueError, match=r"pass the 2-D \('ep', 'tp'\) mesh"):
        ExpertTensorParallel(em.ep)
    return True


def test_expert_tensor_parallel_refuses_bad_input_on_every_rank():
    assert run_ranks(_refusals, 2) == [True, True]
