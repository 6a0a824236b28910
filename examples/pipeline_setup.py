"""Pipeline parallelism for ``examples/train.py``: ``--pp N [--schedule 1f1b] [--microbatches M]``.

``run_pipeline(args)`` is the whole pipelined job: a 4-D mesh ``pp x dp_replicate x dp_shard x
tp``, the Llama split into balanced stages (measured forward+backward time on a sample batch,
``--pp-cost`` to change), each stage tensor-parallelised on ``tp`` and ``fully_shard``-ed on the
dp axes, a `PipelineSchedule` per step. Data, optimizer, logging and checkpoints are those of the
plain job, and checkpoints carry the unsplit model's names, so ``--save`` at ``--pp 2`` resumes
at ``--pp 1`` (and the other way round).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise.checkpoint as ckpt
import shardwise.composable as sw
from examples.data import global_batch, inputs_and_targets, local_slice
from examples.model import Llama, LlamaConfig
from examples.parallel import block_tp_plan
from shardwise.mesh import init_distributed, init_mesh, pipeline_mesh


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline flags of ``examples/train.py``."""
    g = p.add_argument_group("pipeline parallelism")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (outermost mesh axis)")
    g.add_argument("--schedule", default="1f1b", choices=list(sw.SCHEDULES), help="pipeline schedule")
    g.add_argument("--microbatches", type=int, default=None, help="per step; default 2 x pp")
    g.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per rank (interleaved_1f1b; default 2 there, else 1)")
    g.add_argument("--pp-cost", default="time", choices=["time", "params", "activations"],
                   help="what the automatic split balances")


def tp_stage(stage, tp_mesh, uneven_shards: bool = False) -> None:
    """Tensor-parallelise one stage: its blocks, and the embedding / head where it holds them.
    ``uneven_shards=True`` when the sequence length is not a multiple of the tp size."""
    tp = tp_mesh.size()
    plan = {f"layers.{i}.{k}": v for i in stage.block_ids
            for k, v in block_tp_plan(sw, True, uneven_shards).items()}
    if stage.is_first:
        plan["tok_embeddings"] = sw.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.is_last:
        plan["norm"] = sw.SequenceParallel(uneven_shards=uneven_shards)
        plan["output"] = sw.ColwiseParallel(input_layouts=Shard(1), use_local_output=False,
                                            uneven_shards=uneven_shards)
    sw.parallelize_module(stage.module, tp_mesh, plan)
    for blk in stage.blocks:
        if blk.attention.n_heads % tp or blk.attention.n_kv_heads % tp:
            raise ValueError(f"--tp {tp} must divide the heads and kv heads")
        blk.attention.n_heads //= tp
        blk.attention.n_kv_heads //= tp


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float() if not isinstance(logits, DTensor) else logits.flatten(0, 1),
                           targets.flatten())


def run_pipeline(args: argparse.Namespace) -> list[float]:
    """Train with ``args.pp`` pipeline stages; returns the loss of each step (global batch mean,
    the same on every rank), like ``examples.train.main``."""
    from examples.train_loop import finish, mean_over_mesh, mesh_device

    t0 = time.perf_counter()
    rank, world = init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    if world % (args.pp * args.dp_replicate * args.tp):
        raise ValueError(f"world size {world} is not divisible by pp*dp_replicate*tp = "
                         f"{args.pp}*{args.dp_replicate}*{args.tp}")
    from examples.cp import CPWiring  # --cp: sequence sharded over the cp ranks of each stage

    cpx = CPWiring.of(args)
    mesh = init_mesh(pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp, cp=cpx.cp,
                     ep=getattr(args, "ep", 1))
    dp_names = ("dp_replicate", "dp_shard") if args.dp_replicate > 1 else ("dp_shard",)
    dp_mesh = mesh[dp_names]
    dp_size = dp_mesh.size()
    dp_rank = dp_mesh.get_local_rank() if dp_mesh.ndim == 1 else \
        dp_mesh.get_local_rank(0) * dp_mesh.size(1) + dp_mesh.get_local_rank(1)
    dp_mesh = cpx.shard_mesh(mesh, dp_mesh)  # dp_shard x cp under --cp: fully_shard and the loss mean
    spec = sw.get_schedule(args.schedule)
    v = args.virtual_stages or (2 if spec.virtual else 1)
    m = args.microbatches or 2 * args.pp
    if args.batch_size % (dp_size * m):
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by dp size ({dp_size}) x "
                         f"--microbatches ({m})")
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    model = Llama(cfg, generator=torch.Generator().manual_seed(args.seed))
    if getattr(args, "experts", 0):  # mixture of experts (examples/moe.py)
        from examples.moe import MoEPipelineAux, moe_llama, shard_moe_stage
        model = moe_llama(cfg, args.experts, args.top_k, torch.Generator().manual_seed(args.seed))
    device = mesh_device(mesh)
    sample_in, sample_tg = inputs_and_targets(local_slice(
        global_batch(1, args.batch_size, args.seq_len, args.vocab, args.seed), 0, dp_size * m))
    split = sw.pipeline_split(model, pipeline_mesh(mesh), virtual_stages=v, cost=args.pp_cost, placement=spec.placement,
                              sample=lambda mod: _loss(mod(sample_in), sample_tg), verbose=rank == 0)
    model.zero_grad(set_to_none=True)
    for st in split.stages:
        if args.tp > 1:
            tp_stage(st, mesh["tp"], uneven_shards=(args.seq_len // cpx.cp) % args.tp != 0)
        if getattr(args, "experts", 0):
            shard_moe_stage(st, mesh, args.ep)
        for blk in st.blocks:
            sw.fully_shard(blk, mesh=dp_mesh)
        sw.fully_shard(st.module, mesh=dp_mesh)
    cpx.wire(split, mesh, args.seq_len, device)
    sched = sw.PipelineSchedule(split, schedule=args.schedule, microbatches=m, loss_fn=_loss,
                                loss_context=sw.loss_parallel if args.tp > 1 else None)
    aux = MoEPipelineAux(split, cfg.n_layers, m) if getattr(args, "experts", 0) else None
    optim = torch.optim.AdamW(split.module.parameters(), lr=args.lr)
    say(f"mesh: shape={tuple(mesh.shape)} names={mesh.mesh_dim_names}; schedule {args.schedule}, "
        f"{m} microbatches, {v} stage(s) per rank")
    start = 1
    if args.resume:
        state = {"model": sw.pipeline_state_dict(split), "optim": sw.pipeline_optimizer_state_dict(split, optim),
                 "trainer": {"step": 0}}
        ckpt.load(state, args.resume)
        sw.set_pipeline_state_dict(split, state["model"])
        sw.set_pipeline_optimizer_state_dict(split, optim, state["optim"])
        start = int(state["trainer"]["step"]) + 1
        say(f"resumed from {args.resume}: continuing at step {start}")
    t1 = time.perf_counter()
    losses: list[float] = []
    for step in range(start, args.steps + 1):
        tokens = local_slice(global_batch(step, args.batch_size, args.seq_len, args.vocab, args.seed), dp_rank, dp_size)
        inputs, targets = cpx.shard(*(t.to(device) for t in inputs_and_targets(tokens)))
        mb_losses = sched.step(inputs, targets)
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = mb_losses.mean() + (aux.take(split.pp_group, device) if aux else 0.0)
        losses.append(mean_over_mesh(loss.to(device), dp_mesh).item())
        if step == start or step % args.log_every == 0 or step == args.steps:
            say(f"step {step:4d}  loss {losses[-1]:.4f}")
    t2 = time.perf_counter()
    if args.save:
        ckpt.save({"model": sw.pipeline_state_dict(split), "optim": sw.pipeline_optimizer_state_dict(split, optim),
                   "trainer": {"step": args.steps}}, args.save)
        say(f"saved step {args.steps} to {args.save} (resume with --resume at any --pp)")
    if losses:
        say(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    say(f"time: setup {t1 - t0:.1f}s, train {t2 - t1:.1f}s ({(t2 - t1) / max(args.steps, 1) * 1e3:.0f} ms/step)")
    finish(say, args, losses)  # the same last line as the other paths: result: steps=S trained=T samples=N loss=L
    return losses
