"""Pipeline parallelism: shardwise's runtime against torch.distributed.pipelining, automatic vs
uniform split with a heavy head, measured bubble vs theory, peak memory per stage.

    python benchmarks/pipeline.py --reps 8          # 2 gloo ranks on CPU, one thread each

Parts (all ``pp=2``; 2 ranks except ``composed``; the Llama of ``examples/model.py``, same seed and batches):

1. ``vs torch``: one split (uniform), the same schedule (1F1B, then GPipe) and microbatches;
   shardwise's `PipelineSchedule` and torch's ``PipelineStage`` + ``Schedule1F1B`` /
   ``ScheduleGPipe`` on stage modules holding the same blocks. Steps alternate between the
   two; a step's time is rank 0's wall time between two barriers, its CPU time the process CPU
   time (compute and gloo threads) summed over the ranks, which other load on the machine
   disturbs less; medians and the median of per-pair ratios shardwise / torch.
2. ``auto vs uniform``: a model whose output head is heavy (large vocabulary): the automatic
   split (measured time) against the uniform one, same schedule; ratio of step times, and of
   the slowest stage's compute CPU time per step (what sets a pipeline's step time when every
   rank has its own core; on a shared, oversubscribed machine wall times mostly measure the
   total work).
3. ``bubble``: per rank ``1 - (compute + send) / step`` of shardwise's steps (``last_timing``), against
   ``(p - 1) / (m + p - 1)``.
4. ``memory``: peak tensor bytes per stage over one step (`benchmarks.tracker.AllocationTracker`,
   parameters included), GPipe vs 1F1B.
5. ``composed`` (4 ranks: ``pp=2 x dp_shard=2``): each stage's blocks and stage module sharded
   on the dp axis. shardwise: ``fully_shard`` + `PipelineSchedule`; torch (torchtitan's stack):
   torch's FSDP2 ``fully_shard`` + ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe``
   (torch's schedules switch FSDP2's gradient sync off between microbatches, so both reduce once
   per step). Same uniform split, schedule, microbatches and per-rank batches; steps alternate.
   Two settings, like for like: ``kept`` — parameters stay gathered across microbatches
   (shardwise's default; torch with ``reshard_after_forward=False``, torchtitan's default with
   a pipeline) — and ``resharded`` — FSDP's per-microbatch resharding (shardwise with
   ``reshard_between_microbatches=True``; torch FSDP2's default).
6. ``ahead``: shardwise 1F1B with and without receiving ahead ([Note: receiving ahead] in
   ``composable/_pipeline/_runtime/_p2p.py``), alternating, same split; ratio of wall and CPU times.

The zero-bubble schedules (against torch's, their gain over 1F1B, their bubble) are measured by
``benchmarks/pipeline_zb.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shardwise.composable as sw  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TorchStage(nn.Module):
    """A stage for torch.distributed.pipelining: the given blocks of ``model``, plus the embedding
    on the first stage and norm + head on the last."""

    def __init__(self, model: Llama, ids, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.tok = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("cos", model.rope_cos, persistent=False)
        self.register_buffer("sin", model.rope_sin, persistent=False)

    def forward(self, x):
        h = self.tok(x) if self.first else x
        T = h.shape[1]
        for blk in self.layers.values():
            h = blk(h, self.cos[:T], self.sin[:T])
        return self.output(self.norm(h)) if self.last else h


def _batch(cfg, n, t, step):
    tok = torch.randint(0, cfg.vocab_size, (n, t + 1), generator=torch.Generator().manual_seed(step))
    return tok[:, :-1], tok[:, 1:]


def _timed(fn, cpu=None):
    """Wall time of ``fn`` between barriers; appends to ``cpu`` the process CPU time summed over ranks."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    wall = time.perf_counter() - t0
    if cpu is not None:
        t = torch.tensor([c1 - c0], dtype=torch.float64)
        dist.all_reduce(t)
        cpu.append(float(t))
    return wall


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _ours(cfg, m, schedule, split_points=None, cost="params", sample=None):
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    split = sw.pipeline_split(model, None, cost=cost, split_points=split_points, sample=sample, verbose=False)
    sched = sw.PipelineSchedule(split, schedule=schedule, microbatches=m, loss_fn=_ce)
    return split, sched


def _torch(cfg, m, schedule, bounds):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    mod = TorchStage(model, range(bounds[rank], bounds[rank + 1]), rank == 0, rank == 1)
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return mod, cls(stage, n_microbatches=m, loss_fn=_ce)


def _run_torch(sched, x, y):
    if dist.get_rank() == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])


def _pair_stats(a, b, ca, cb) -> dict:
    return {"shardwise_s": statistics.median(a), "torch_s": statistics.median(b),
            "ratio": statistics.median(p / q for p, q in zip(a, b)),
            "shardwise_cpu_s": statistics.median(ca), "torch_cpu_s": statistics.median(cb),
            "cpu_ratio": statistics.median(p / q for p, q in zip(ca, cb))}


def bench_composed(rank, world, args):
    """Part 5 on 4 ranks: pp=2 x dp_shard=2, shardwise against torch's FSDP2 + pipelining."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    mesh = init_mesh(pp=2, dp_shard=2)
    dp = data_parallel_mesh(mesh)
    pp_rank = pipeline_mesh(mesh).get_local_rank()
    x, y = _batch(cfg, 2 * args.batch, args.seq, 1)
    x, y = x.chunk(2)[dp.get_local_rank()], y.chunk(2)[dp.get_local_rank()]  # each dp rank its own rows
    m, bounds = args.microbatches, sw.uniform_bounds(cfg.n_layers, 2)
    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for schedule, kept in (("1f1b", True), ("gpipe", True), ("1f1b", False), ("gpipe", False)):
        model = Llama(cfg, generator=torch.Generator().manual_seed(0))
        split = sw.pipeline_split(model, pipeline_mesh(mesh), cost="params", split_points=list(bounds), verbose=False)
        for st in split.stages:
            for blk in st.blocks:
                sw.fully_shard(blk, mesh=dp)
            sw.fully_shard(st.module, mesh=dp)
        ours = sw.PipelineSchedule(split, schedule=schedule, microbatches=m, loss_fn=_ce,
                                   reshard_between_microbatches=not kept)
        tmodel = Llama(cfg, generator=torch.Generator().manual_seed(0))
        mod = TorchStage(tmodel, range(bounds[pp_rank], bounds[pp_rank + 1]), pp_rank == 0, pp_rank == 1)
        for blk in mod.layers.values():
            torch_fully_shard(blk, mesh=tmesh["dp"], reshard_after_forward=not kept)
        torch_fully_shard(mod, mesh=tmesh["dp"], reshard_after_forward=not kept)
        stage = PipelineStage(mod, pp_rank, 2, torch.device("cpu"), group=tmesh["pp"].get_group())
        theirs = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, n_microbatches=m, loss_fn=_ce)

        def run_theirs():
            if pp_rank == 0:
                theirs.step(x)
            else:
                theirs.step(target=y, losses=[])
        for _ in range(2):
            mine = ours.step(x, y)
            theirs_losses = [] if pp_rank == 1 else None
            if pp_rank == 0:
                theirs.step(x)
            else:
                theirs.step(target=y, losses=theirs_losses)
                diff = max(abs(float(p) - float(q)) for p, q in zip(mine, theirs_losses))
                assert diff <= 1e-5 * abs(float(mine[0])), f"the two runs compute different losses ({diff})"
        a, b, ca, cb = [], [], [], []
        for _ in range(args.reps):
            a.append(_timed(lambda: ours.step(x, y), ca))
            b.append(_timed(run_theirs, cb))
        out[f"composed_{schedule}_{'kept' if kept else 'resharded'}"] = _pair_stats(a, b, ca, cb)
        ours.close()
    return out


def bench(rank, world, args):
    torch.set_num_threads(1)
    out = {}
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    x, y = _batch(cfg, args.batch, args.seq, 1)
    m = args.microbatches
    bounds = sw.uniform_bounds(cfg.n_layers, 2)
    for schedule in ("1f1b", "gpipe") if "torch" in args.parts else ():
        split, ours = _ours(cfg, m, schedule, split_points=list(bounds))
        mod, theirs = _torch(cfg, m, schedule, bounds)
        for _ in range(2):
            ours.step(x, y)
            _run_torch(theirs, x, y)
        a, b, bubbles, ca, cb = [], [], [], [], []
        for _ in range(args.reps):
            a.append(_timed(lambda: ours.step(x, y), ca))
            lt = ours.last_timing  # idle: neither in an action nor issuing its sends
            bubbles.append(1 - (lt["compute_s"] + lt["send_s"]) / lt["step_s"])
            b.append(_timed(lambda: _run_torch(theirs, x, y), cb))
        out[f"vs_torch_{schedule}"] = _pair_stats(a, b, ca, cb)
        out[f"bubble_{schedule}"] = {"measured": statistics.median(bubbles),
                                     "theory": sw.theoretical_bubble(2, m)}
        ours.close()
    if "ahead" in args.parts:
        _, on = _ours(cfg, m, "1f1b", split_points=list(bounds))
        _, off = _ours(cfg, m, "1f1b", split_points=list(bounds))
        off.p2p.ahead = False
        for _ in range(2):
            on.step(x, y)
            off.step(x, y)
        a, b, ca, cb = [], [], [], []
        for _ in range(args.reps):
            a.append(_timed(lambda: on.step(x, y), ca))
            b.append(_timed(lambda: off.step(x, y), cb))
        stats = _pair_stats(a, b, ca, cb)
        out["ahead_vs_not_1f1b"] = {k.replace("shardwise", "ahead").replace("torch", "not_ahead"): v
                                    for k, v in stats.items()}
        on.close()
        off.close()
    # memory per stage, gpipe vs 1f1b
    from benchmarks.tracker import AllocationTracker
    for schedule in ("gpipe", "1f1b") if "memory" in args.parts else ():
        split, ours = _ours(cfg, args.mem_microbatches, schedule, split_points=list(bounds))
        ours.step(x, y)
        tr = AllocationTracker()
        tr.track(split.module.parameters(), "params")
        tr.track([p.grad for p in split.module.parameters()], "grads")
        with tr:
            ours.step(x, y)
        out[f"peak_bytes_{schedule}_m{args.mem_microbatches}"] = tr.peak
    if "split" not in args.parts:
        return out
    # heavy head: auto (measured) vs uniform split
    heavy = LlamaConfig(vocab_size=args.heavy_vocab, dim=args.heavy_dim, n_layers=args.layers, n_heads=4,
                        max_seq_len=args.seq)
    hx, hy = _batch(heavy, args.batch, args.seq, 2)
    sample = lambda mdl: _ce(mdl(hx[: args.batch // m]), hy[: args.batch // m])  # noqa: E731
    split_a, auto = _ours(heavy, m, "1f1b", cost="time", sample=sample)
    split_u, uni = _ours(heavy, m, "1f1b", split_points=list(bounds))
    for _ in range(2):
        auto.step(hx, hy)
        uni.step(hx, hy)
    a, u, sa, su = [], [], [], []
    for _ in range(args.reps):
        a.append(_timed(lambda: auto.step(hx, hy)))
        sa.append(_max_over_ranks(auto.last_timing["compute_cpu_s"]))
        u.append(_timed(lambda: uni.step(hx, hy)))
        su.append(_max_over_ranks(uni.last_timing["compute_cpu_s"]))
    out["auto_vs_uniform"] = {"auto_bounds": split_a.plan.bounds, "auto_costs_ms": [c * 1e3 for c in split_a.plan.costs],
                              "auto_s": statistics.median(a), "uniform_s": statistics.median(u),
                              "ratio": statistics.median(p / q for p, q in zip(a, u)),
                              "auto_slowest_stage_cpu_s": statistics.median(sa),
                              "uniform_slowest_stage_cpu_s": statistics.median(su),
                              "slowest_stage_ratio": statistics.median(p / q for p, q in zip(sa, su))}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--heavy-vocab", type=int, default=16384)
    p.add_argument("--heavy-dim", type=int, default=256, help="width of the heavy-head model")
    p.add_argument("--parts", default="torch,memory,split,composed,ahead",
                   help="comma list of: torch, memory, split, composed, ahead")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--mem-microbatches", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from tests._dist import run_ranks

    res = run_ranks(bench, 2, args, timeout=1200) if set(args.parts.split(",")) - {"composed"} else []
    if "composed" in args.parts:
        res = [dict(r, **c) for r, c in zip(res or [{}] * 4, run_ranks(bench_composed, 4, args, timeout=1200))]
    for r, out in enumerate(res):
        print(f"--- rank {r} (stage {r})")
        for k, v in out.items():
            print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
