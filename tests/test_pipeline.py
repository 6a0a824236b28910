"""Pipeline parallelism against one process on the whole batch: every schedule, uneven splits,
pp x fully_shard, pp x TP, and bad input (one error on every rank, no hang)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from examples.parallel import block_tp_plan
from shardwise.composable._pipeline import PipelineError, PipelineSchedule, pipeline_split
from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh
from tests._dist import run_ranks

TOL = 1e-6
CFG = LlamaConfig(vocab_size=17, dim=16, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _ce_parallel(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(n=8, t=7, seed=1):
    tokens = torch.randint(0, CFG.vocab_size, (n, t + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_stage(stage, tp_mesh, tp):
    """TP the blocks of a stage (and the embedding / head where it holds them)."""
    from torch.distributed.tensor import Replicate, Shard
    plan = {f"layers.{i}.{k}": v for i in stage.block_ids for k, v in block_tp_plan(sw, True).items()}
    if stage.is_first:
        plan["tok_embeddings"] = sw.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:
        # later stages get a sequence-sharded activation already
        pass
    if stage.is_last:
        plan["norm"] = sw.SequenceParallel()
        plan["output"] = sw.ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    sw.parallelize_module(stage.module, tp_mesh, plan)
    for i in stage.block_ids:
        att = stage.module.layers._modules[str(i)].attention
        att.n_heads //= tp
        att.n_kv_heads //= tp


def _run(rank, world_size, opts):
    pp = opts.get("pp", world_size)
    dp_shard, tp, v = opts.get("dp_shard", 1), opts.get("tp", 1), opts.get("v", 1)
    cfg = opts.get("cfg", CFG)
    ref = Llama(cfg, generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(ref)
    inputs, targets = _batch(opts.get("batch", 8))
    ref_loss = _ce(ref(inputs), targets)
    ref_loss.backward()
    mesh = init_mesh(pp=pp, dp_shard=dp_shard, tp=tp, device_type="cpu") if pp > 1 else None
    split = pipeline_split(model, pipeline_mesh(mesh) if mesh is not None else None, virtual_stages=v,
                           cost=opts.get("cost", "params"), split_points=opts.get("split_points"),
                           sample=(lambda m: _ce(m(inputs), targets)) if opts.get("cost") == "time" else None,
                           verbose=False)
    dp_rank, dp_size = 0, 1
    if mesh is not None and (dp_shard > 1 or tp > 1):
        for st in split.stages:
            if tp > 1:
                _tp_stage(st, mesh["tp"], tp)
            if dp_shard > 1:
                dp_mesh = data_parallel_mesh(mesh)
                for b in st.blocks:
                    sw.fully_shard(b, mesh=dp_mesh)
                sw.fully_shard(st.module, mesh=dp_mesh)
        dp_rank, dp_size = mesh["dp_shard"].get_local_rank(), dp_shard
    per = inputs.shape[0] // dp_size
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    sched = PipelineSchedule(split, schedule=opts.get("schedule", "1f1b"), microbatches=opts.get("m", 4),
                             loss_fn=_ce_parallel if tp > 1 else _ce,
                             loss_context=sw.loss_parallel if tp > 1 else None,
                             reduce_every_microbatch=opts.get("every", False))
    losses = sched.step(inputs[sl], targets[sl])
    loss = losses.mean()
    if dp_size > 1:
        t = torch.tensor([float(loss)], dtype=torch.float64)
        dist.all_reduce(t, group=mesh["dp_shard"].get_group())
        loss = t[0] / dp_size
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst, names = 0.0, []
    for n, p in split.module.named_parameters():
        g = _full(p.grad)
        r = ref_grads[n]
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
        names.append(n)
    return {"loss_err": abs(float(loss) - ref_loss.item()) / ref_loss.item(), "grad_err": worst, "names": names,
            "bounds": split.plan.bounds}


def _check(results, n_layers=4):
    names = set()
    for r in results:
        assert r["loss_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        names |= set(r["names"])
    ref = {n for n, _ in Llama(CFG).named_parameters()}
    assert names == ref, f"the stages together hold {sorted(names ^ ref)} differently from the unsplit model"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_matches_one_process(schedule):
    _check(run_ranks(_run, 2, {"schedule": schedule}, timeout=90))


def test_pp2_interleaved_matches_one_process():
    _check(run_ranks(_run, 2, {"schedule": "interleaved_1f1b", "v": 2}, timeout=90))
