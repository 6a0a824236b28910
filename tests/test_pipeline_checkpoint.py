"""Checkpoints of a pipelined model carry the unsplit model's names: saved at pp=2 (x dp_shard=2),
loaded at pp=1 and at pp=4 bit-exact, and training resumed at pp=1 equals uninterrupted pp=2
training; and a pp=1 checkpoint loads into pp=2."""

from __future__ import annotations

import copy

import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardwise.checkpoint as ckpt
import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from shardwise.composable import PipelineSchedule, pipeline_split
from shardwise.composable import pipeline_optimizer_state_dict, pipeline_state_dict, set_pipeline_optimizer_state_dict, set_pipeline_state_dict
from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh
from tests._dist import run_ranks

CFG = LlamaConfig(vocab_size=17, dim=16, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _batch(step):
    tokens = torch.randint(0, CFG.vocab_size, (8, 8), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _pp_model(dp_shard, pp=2, tp=1):
    mesh = init_mesh(pp=pp, dp_shard=dp_shard, tp=tp, device_type="cpu")
    split = pipeline_split(Llama(CFG, generator=torch.Generator().manual_seed(0)), pipeline_mesh(mesh),
                           cost="params", verbose=False)
    if tp > 1:
        from examples.pipeline_setup import tp_stage
        for st in split.stages:
            tp_stage(st, mesh["tp"], uneven_shards=True)  # 7 tokens on 2 tp ranks
    if dp_shard > 1:
        for st in split.stages:
            for b in st.blocks:
                sw.fully_shard(b, mesh=data_parallel_mesh(mesh))
            sw.fully_shard(st.module, mesh=data_parallel_mesh(mesh))
    sched = PipelineSchedule(split, schedule="1f1b", microbatches=2, loss_fn=_ce)
    opt = torch.optim.AdamW(split.module.parameters(), lr=1e-2)
    return mesh, split, sched, opt


def _pp_step(mesh, sched, opt, step, dp_shard):
    x, y = _batch(step)
    r, per = mesh["dp_shard"].get_local_rank(), 8 // dp_shard
    losses = sched.step(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
    opt.step()
    opt.zero_grad()
    return losses


def _save_pp2(rank, world_size, path, dp_shard):
    mesh, split, sched, opt = _pp_model(dp_shard)
    for step in (1, 2):
        _pp_step(mesh, sched, opt, step, dp_shard)
    ckpt.save({"model": pipeline_state_dict(split), "optim": pipeline_optimizer_state_dict(split, opt)}, path)
    saved = {n: _full(p) for n, p in split.module.named_parameters()}
    losses = _pp_step(mesh, sched, opt, 3, dp_shard)
    return saved, losses.tolist()


def _load_pp1(rank, world_size, path):
    model = Llama(CFG, generator=torch.Generator().manual_seed(5))  # other weights: the load must set them all
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": ckpt.get_model_state_dict(model), "optim": ckpt.get_optimizer_state_dict(model, opt)}
    ckpt.load(state, path)
    ckpt.set_model_state_dict(model, state["model"])
    ckpt.set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch(3)
    return loaded, _ce(model(x), y).item()


def test_pp2_checkpoint_loads_at_pp1_and_resumes(tmp_path):
    path = str(tmp_path / "ck")
    pp2 = run_ranks(_save_pp2, 4, path, 2, timeout=120)
    saved = {}
    for params, _ in pp2:
        saved.update(params)
    assert set(saved) == {n for n, _ in Llama(CFG).named_parameters()}
    (loaded, loss1), = run_ranks(_load_pp1, 1, path, timeout=60)
    for n, t in saved.items():
        assert torch.equal(loaded[n], t), f"{n} differs after the pp=2 -> pp=1 round trip"
    at_pp4 = {}
    for part in run_ranks(_load_pp2, 4, path, timeout=60):  # and at pp=4, one block per stage
        at_pp4.update(part)
    assert set(at_pp4) == set(saved) and all(torch.equal(at_pp4[n], saved[n]) for n in saved), "pp=2 -> pp=4"
    # step 3: ranks 0 and 1 are the two dp ranks of stage 0; each returns its half's microbatch losses
    cont = (sum(pp2[0][1]) / 2 + sum(pp2[1][1]) / 2) / 2
    assert abs(loss1 - cont) <= 1e-6 * abs(cont), (loss1, cont)


def _save_pp1(rank, world_size, path):
    model = Llama(CFG, generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(1)
    _ce(model(x), y).backward()
    opt.step()
    ckpt.save({"model": ckpt.get_model_state_dict(model), "optim": ckpt.get_optimizer_state_dict(model, opt)}, path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_pp2(rank, world_size, path):
    mesh, split, sched, opt = _pp_model(1, pp=world_size)
    state = {"model": pipeline_state_dict(split), "optim": pipeline_optimizer_state_dict(split, opt)}
    ckpt.load(state, path)
    set_pipeline_state_dict(split, state["model"])
    set_pipeline_optimizer_state_dict(split, opt, state["optim"])
    return {n: _full(p) for n, p in split.module.named_parameters()}


def test_pp1_checkpoint_loads_at_pp2(tmp_path):
    path = str(tmp_path / "ck1")
    (ref,) = run_ranks(_save_pp1, 1, path, timeout=60)
    got = {}
    for part in run_ranks(_load_pp2, 2, path, timeout=60):
        got.update(part)
    assert set(got) == set(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def _save_pp2_tp2(rank, world_size, path):
    mesh, split, sched, opt = _pp_model(1, tp=2)
    ckpt.save({"model": pipeline_state_dict(split), "optim": pipeline_optimizer_state_dict(split, opt)}, path)
    return {n: _full(p) for n, p in split.module.named_parameters()}


def test_pp2_x_tp2_checkpoint_loads_at_pp1(tmp_path):
    path = str(tmp_path / "cktp")
    saved = {}
    for part in run_ranks(_save_pp2_tp2, 4, path, timeout=90):
        saved.update(part)
    (loaded, _), = run_ranks(_load_pp1, 1, path, timeout=60)
    assert set(loaded) == set(saved)
    for n, t in saved.items():
        assert torch.equal(loaded[n], t), f"{n} differs after the pp=2 x tp=2 -> pp=1 round trip"
