"""Train the small Llama of ``examples/model.py`` with shardwise's ``fully_shard`` (FSDP / HSDP).

Launch one process per device::

    torchrun --nproc-per-node 4 examples/train.py                      # FSDP over 4 ranks
    torchrun --nproc-per-node 4 examples/train.py --dp-replicate 2     # HSDP: 2 replicas x 2 shards

CPU processes talk over gloo, CUDA ones over NCCL. Every rank builds the same
model from ``--seed``, each ``TransformerBlock`` is sharded on its own and then
the root; each data-parallel rank trains on its contiguous slice of the global
batch of :mod:`examples.data`. Rank 0 prints the mesh, the parameter bytes each
rank holds against the full model, the loss every ``--log-every`` steps (the
mean over the data-parallel ranks) and finally the first and last loss.

``--steps`` is the total: ``--resume DIR`` continues from the saved step up to ``--steps``,
and ``--save DIR`` prints the exact command that does so. ``--checkpoint-dir DIR`` resumes and
saves by itself at any world size (:mod:`examples.elastic`, docs/elastic.md). The last line is
``result: steps=S trained=T samples=N loss=L`` (``examples.elastic.parse_result``), whichever path
trained. Arguments are checked before anything is built (:mod:`examples.preflight`); see
docs/example.md. This file holds the arguments and the job's steps in order; the training loop
is :mod:`examples.train_loop`, saving and resuming :mod:`examples.checkpoints`, building and
sharding the model :mod:`examples.parallel`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

# the helpers, by concept; their names stay reachable as examples.train.<name>
from examples.checkpoints import app_state, dir_bytes, resume, save_or_rescue  # noqa: E402,F401
from examples.data import loss_floor  # noqa: E402
from examples.model import LlamaConfig  # noqa: E402
from examples.optimizers import MUON_LR, OPTIMIZERS, build_optimizer  # noqa: E402
from examples.parallel import build_and_shard  # noqa: E402
from examples.preflight import MODEL_ARGS, UsageError, preflight  # noqa: E402
from examples.train_loop import (DP_DIMS, data_parallel_rank, finish, mean_over_mesh, mesh_device,  # noqa: E402,F401
                                 say_summary, train)
import shardwise.checkpoint as ckpt  # noqa: E402
from shardwise.mesh import data_parallel_mesh, init_distributed, init_mesh  # noqa: E402

FAIL_WAIT_S = 2.0


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(local, full)``: bytes of parameters this rank stores, and of the unsharded model."""
    local = full = 0
    for p in model.parameters():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        full += p.numel() * p.element_size()  # a DTensor's numel is its global size
    return local, full


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dp-replicate", type=int, default=1, help="replica groups (HSDP outer axis)")
    p.add_argument("--dp-shard", type=int, default=-1, help="ranks one copy is sharded over; -1 = the rest")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (consecutive, within a host)")
    p.add_argument("--steps", type=int, default=30,
                   help="total steps: a run resumed at step s trains steps s+1 .. STEPS")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divide --dim into an even head width)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query attention); "
                   "None = --heads")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, split over the dp ranks")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps (and first, last)")
    p.add_argument("--save", metavar="DIR", help="save model + optimizer + step to DIR at the end (DIR is checked "
                   "before step 1; if saving fails at the end, the weights go to a temporary folder, named)")
    p.add_argument("--resume", metavar="DIR", help="resume from a checkpoint saved by --save (any world size); "
                   "training continues up to --steps")
    p.add_argument("--experts", type=int, default=0, help="MoE feed-forward with N experts (0: dense; examples/moe.py)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (with --experts)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, carved out of --dp-shard (with --experts)")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="torch.compile(model, fullgraph=True) the sharded model, the whole step one graph "
                        "(docs/compile.md); BACKEND defaults to inductor")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (CPU runs only)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw (every parameter), or muon: torch.optim.Muon on the hidden matrices, each updated "
                        "whole by one owner rank (docs/optimizers.md), AdamW on the rest")
    p.add_argument("--muon-lr", type=float, default=MUON_LR, help="Muon's learning rate (with --optimizer muon)")
    from examples.pipeline_setup import add_pipeline_args  # pipeline flags: --pp, --schedule, --microbatches

    add_pipeline_args(p)
    from examples.elastic import add_elastic_args  # --checkpoint-dir, --checkpoint-every, heartbeat knobs

    add_elastic_args(p)
    from examples.cp import add_cp_args  # context parallelism: --cp, --cp-method

    add_cp_args(p)
    from examples.fault_tolerance import add_ft_args  # --ft-replica-group, --ft-lighthouse: torchft

    add_ft_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def resume_command(args: argparse.Namespace, world_size: int, path: str, steps: int) -> str:
    """The command line that resumes from ``path`` up to ``steps``: this job's non-default
    arguments, without ``--save``/``--resume``/``--steps``."""
    parts = ["torchrun", "--nproc-per-node", str(world_size), _script(), "--resume", path, "--steps", str(steps)]
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and action.dest not in ("help", "save", "resume", "steps") \
                and value != action.default:
            parts += [action.option_strings[0], str(value)]
    return " ".join(shlex.quote(x) for x in parts)


def _script() -> str:
    rel = os.path.relpath(__file__)
    return __file__ if rel.startswith("..") else rel


def _fail(message: str) -> None:
    """One line on rank 0 (stderr), nothing on the others; exit status 2 like argparse.

    The other ranks wait ``FAIL_WAIT_S`` first: torchrun stops every worker as soon as one
    exits non-zero, so a rank exiting before rank 0 has printed could swallow the message."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{os.path.basename(_script())}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(FAIL_WAIT_S)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> list[float]:
    """Run the job; return the loss of each step trained (empty when the ``--resume``
    checkpoint already reached ``--steps``). Bad arguments exit with status 2 before
    anything is built (`examples.preflight`)."""
    args = parse_args(argv)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        from examples.cp import cp_world  # --cp N: the data-parallel layout spans world / N ranks

        checked = preflight(args, cp_world(args, world_env))
    except UsageError as e:
        _fail(str(e))
    if args.save:  # before step 1: a bad --save must not cost the training run
        try:
            ckpt.check_save_target(args.save)
        except ckpt.CheckpointError as e:
            _fail(f"--save {args.save}: {e}")
    if checked.resume_step is not None and checked.resume_step >= args.steps:
        if os.environ.get("RANK", "0") == "0":
            more = args.steps if checked.resume_step == args.steps else checked.resume_step
            print(f"--resume {args.resume} is at step {checked.resume_step} and --steps {args.steps} is the total: "
                  f"nothing left to train. To train {more} more steps run: "
                  f"{resume_command(args, world_env, args.resume, checked.resume_step + more)}", flush=True)
        return []
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(args.threads)
    # the paths below are separate loops; combinations none of them wires are refused here, not ignored
    cp_alone = args.cp > 1 and args.pp == 1 and not args.checkpoint_dir  # the pp and elastic loops wire --cp
    paths = [name for name, on in (("--checkpoint-dir", bool(args.checkpoint_dir)), ("--pp", args.pp > 1),
                                   ("--cp", cp_alone), ("--ft-replica-group", args.ft_replica_group is not None),
                                   ("--experts/--ep", (bool(args.experts) or args.ep > 1) and args.pp == 1)) if on]
    if args.cp > 1 and (args.experts or args.ep > 1):
        paths = ["--cp", "--experts/--ep"]  # the pipeline loop wires each of them, not both together
    if len(paths) > 1:
        _fail(f"{' and '.join(paths)} do not combine in this example yet; run them separately")
    if args.optimizer != "adamw" and (paths or args.cp > 1):
        _fail(f"--optimizer {args.optimizer} is wired into the plain FSDP / HSDP / TP loop only, not with "
              f"{' and '.join(paths or ['--cp'])}; drop one of them")
    if args.experts or args.ep > 1:  # mixture of experts (examples/moe.py)
        from examples.moe import check_moe_args
        try:
            check_moe_args(args.experts, args.top_k, args.ep, checked.dp_shard, args.tp, args.pp)
        except UsageError as e:
            _fail(str(e))
    if args.ft_replica_group is not None:  # one replica group under torchft (docs/fault_tolerance.md)
        from examples.fault_tolerance import check_ft_args, run_ft

        if (problem := check_ft_args(args)) is not None:
            _fail(problem)
        return run_ft(args, checked.dp_shard)
    if args.checkpoint_dir:  # elastic: resume from the latest checkpoint, save every K steps (docs/elastic.md)
        from examples.elastic import run_elastic

        return run_elastic(args, checked.dp_shard)
    if args.pp > 1:  # pipeline parallelism: its own loop, same data, losses and checkpoints
        from examples.pipeline_setup import run_pipeline

        return run_pipeline(args)
    if args.cp > 1:  # context parallelism: sequence sharded over cp ranks, same data and losses
        from examples.cp import run_cp

        return run_cp(args, checked.dp_shard)
    t0 = time.perf_counter()
    rank, world_size = init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)

    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=checked.dp_shard, tp=args.tp, ep=args.ep)
    dp_mesh = data_parallel_mesh(mesh)
    _, dp_size = data_parallel_rank(mesh)
    say(f"world={world_size} device={mesh.device_type}")
    say(f"mesh: shape={tuple(mesh.shape)} names={mesh.mesh_dim_names} ranks={mesh.mesh.tolist()}")
    say(f"dp mesh: shape={tuple(dp_mesh.shape)} names={dp_mesh.mesh_dim_names} (dp size {dp_size})")

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len),
    )
    if args.experts:
        from examples.moe import moe_llama, shard_moe_llama
        model = shard_moe_llama(moe_llama(cfg, args.experts, args.top_k, torch.Generator().manual_seed(args.seed)),
                                mesh, args.ep, uneven_shards=args.seq_len % args.tp != 0)
    else:
        model = build_and_shard(cfg, dp_mesh, seed=args.seed, tp_mesh=mesh["tp"],
                                uneven_shards=args.seq_len % mesh["tp"].size() != 0)

    local, full = param_bytes(model)
    device = mesh_device(mesh)
    mine = torch.tensor([local], dtype=torch.int64, device=device)
    per_rank = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(per_rank, mine)
    per_rank = [int(t.item()) for t in per_rank]
    say(f"model: {cfg}")
    say(f"params: {sum(p.numel() for p in model.parameters())} elements, full model {full} bytes")
    for r, b in enumerate(per_rank):
        say(f"  rank {r}: {b} bytes sharded ({b / full:.1%} of full)")
    say(f"  sum over ranks {sum(per_rank)} bytes = {sum(per_rank) / full:.2f} x full")

    optim = build_optimizer(model, args.optimizer, args.lr, args.muon_lr)
    start = 1
    if args.resume:
        say(f"loading {args.resume} (step {checked.resume_step}) ...", flush=True)
        tl = time.perf_counter()
        step, read = resume(model, optim, args.resume)
        read_all = torch.tensor([read], dtype=torch.int64, device=device)
        dist.all_reduce(read_all)
        start = step + 1
        say(f"loaded step {step} from {args.resume}: {int(read_all.item())} bytes read by {world_size} ranks "
            f"in {time.perf_counter() - tl:.2f}s")
    say(f"training steps {start}..{args.steps} ({args.steps - start + 1} steps), global batch {args.batch_size} x "
        f"{args.seq_len} tokens, {args.batch_size // dp_size} rows per dp rank; "
        f"loss floor ln(branching) = {loss_floor():.3f}")
    t1 = time.perf_counter()
    # --compile: the whole model in one graph (docs/compile.md); the first step compiles it
    run, first = (torch.compile(model, fullgraph=True, backend=args.compile) if args.compile else model), []

    def log(step: int, loss: float) -> None:
        if args.compile and not first:
            first.append(step)
            say(f"compile: the first step (torch.compile fullgraph, {args.compile}) took {time.perf_counter() - t1:.1f}s")
        say(f"step {step:4d}  loss {loss:.4f}")
    losses = train(
        run, dp_mesh, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        vocab=args.vocab, lr=args.lr, seed=args.seed, log_every=args.log_every,
        log=log, optim=optim, start_step=start,
    )
    say_summary(say, losses, t0, t1, time.perf_counter())
    if args.save:
        say(f"saving step {args.steps} to {args.save} ...", flush=True)
        ts = time.perf_counter()
        model_args = {name: getattr(args, name) for name in MODEL_ARGS}
        where = save_or_rescue(app_state(model, optim, args.steps, model_args), args.save, say)
        if rank == 0:
            say(f"saved step {args.steps} to {where}: {dir_bytes(where)} bytes in "
                f"{time.perf_counter() - ts:.2f}s")
            say(f"resume (on any world size) with: "
                f"{resume_command(args, world_size, where, 2 * args.steps)}")
    finish(say, args, losses)  # the last line: steps, samples, final loss (machine-parseable)
    return losses


if __name__ == "__main__":
    main()
