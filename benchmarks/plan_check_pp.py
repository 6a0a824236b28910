"""``plan_memory(..., pp=2)``'s per-stage estimate against the measured peak of each stage.

    python benchmarks/plan_check_pp.py                 # 4 gloo ranks: pp=2 x dp_shard=2

The ranks build the Llama of ``examples/model.py``, split it in two stages at the parameter-
balanced point (the planner's default), ``fully_shard`` each stage's blocks and stage module
on ``dp_shard=2``, train one untracked step (forward + backward of every microbatch, then
AdamW), then track two steps with `benchmarks.tracker.AllocationTracker` (live tensor
storages). The estimate is ``plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=m,
schedule=..., activation_bytes=A, tokens=batch x seq_len)`` with ``A`` measured as in
``benchmarks/plan_check.py`` (the peak of one forward + loss of the unsharded model on one
data-parallel rank's batch, minus its parameters; ``tokens`` places the head's and embedding's
part of it on their stages). Reported per schedule and stage: the larger peak of the stage's
two ranks against the stage's ``plan.peak``, the plan without ``tokens`` (the head's
activations spread with the blocks), and the ``accumulated_grads`` and ``held_grads`` terms in
the plan. ``zb_h1`` is planned with the default ``kept_grads`` (`DEFAULT_KEPT_GRADS`) for what
its ``I`` keeps. Options: ``--schedules gpipe,1f1b,zb_h1``, ``--microbatches 4`` and the
model's (``--layers``, ``--vocab``, ``--batch-per-rank``, ...); a schedule takes about 20 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.plan_check import add_model_args, batch, model_and_activations  # noqa: E402
from benchmarks.tracker import AllocationTracker  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402

MB = 2**20


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def measure(rank: int, world: int, cfg: LlamaConfig, schedule: str, m: int, args) -> dict:
    import shardwise.composable as sw
    from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(pp=2, dp_shard=2, device_type="cpu")
    dp = data_parallel_mesh(mesh)
    split = sw.pipeline_split(Llama(cfg, generator=torch.Generator().manual_seed(0)), pipeline_mesh(mesh),
                              cost="params", verbose=False)
    for st in split.stages:
        for blk in st.blocks:
            sw.fully_shard(blk, mesh=dp)
        sw.fully_shard(st.module, mesh=dp)
    sched = sw.PipelineSchedule(split, schedule=schedule, microbatches=m, loss_fn=_ce)
    optim = torch.optim.AdamW(split.module.parameters(), lr=1e-3)

    def train(i):
        tokens = batch(i, args, dp.get_local_rank())
        sched.step(tokens[:, :-1], tokens[:, 1:])
        optim.step()
        optim.zero_grad(set_to_none=True)

    train(0)
    tracker = AllocationTracker()
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.track(list(split.module.parameters()) + list(split.module.buffers()) + state)
    with tracker:
        for i in (1, 2):
            train(i)
    return dict(stage=split.pp_rank, peak=tracker.peak)


def main(argv=None) -> None:
    from benchmarks import plan_check_pp as this  # ranks import the function by module name
    from shardwise.composable import plan_memory
    from tests._dist import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(batch_per_rank=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", default="gpipe,1f1b,zb_h1", help="comma list (one stage per rank)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg, meta, A = model_and_activations(args)
    print(f"model: {cfg}; {args.batch_per_rank} x {args.seq_len} tokens per dp rank, {args.microbatches} "
          f"microbatches; A = {A / MB:.1f} MiB; torch {torch.__version__}\n")
    print("| schedule | stage | measured peak MiB (max of its 2 ranks) | plan.peak | error | without tokens | error "
          "| accumulated_grads, held_grads in it |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for schedule in args.schedules.split(","):
        got = run_ranks(this.measure, 4, cfg, schedule, args.microbatches, args, timeout=600)
        kw = dict(pp=2, microbatches=args.microbatches, schedule=schedule, activation_bytes=A)
        plan = plan_memory(meta, (1, 2), "FULL_SHARD", tokens=args.batch_per_rank * args.seq_len, **kw)
        spread = plan_memory(meta, (1, 2), "FULL_SHARD", **kw)
        for s, (st, sp) in enumerate(zip(plan.stages, spread.stages)):
            peak = max(r["peak"] for r in got if r["stage"] == s)
            print(f"| {schedule} | {s} | {peak / MB:.1f} | {st.peak / MB:.1f} | {(st.peak - peak) / peak:+.1%} | "
                  f"{sp.peak / MB:.1f} | {(sp.peak - peak) / peak:+.1%} | {st.accumulated_grads / MB:.1f}, "
                  f"{st.held_grads / MB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
