"""``examples/train.py --ft-replica-group G --ft-lighthouse URL``: one replica group of a job
that survives a lost group inside the step, under torchft (docs/fault_tolerance.md).

Each replica group is an ordinary ``torchrun`` job (its own ``--master-port``) sharded as the
plain path shards it (FSDP, HSDP with ``--dp-replicate``, TP with ``--tp``); the groups meet at a
``torchft_lighthouse``, which forms a quorum every step. Wired as torchtitan wires torchft:
each FSDP unit's ``set_all_reduce_hook`` averages its reduced gradient over the groups of the
quorum through torchft's ``ManagedProcessGroup``; ``torchft.Optimizer`` steps only when every
participant's step succeeded; a group that (re)starts heals from a live one through the
Manager's state-dict functions, which serve the model and optimizer state dicts taken once at
start (shardwise updates those tensors in place, so they stay live). The step counter is the
Manager's: a healed group continues at its peers' step, on that step's data. Every group builds
the same weights from ``--seed``, so the first step needs no heal (``init_sync=False``): with
every group up from the start the job trains exactly as one process on the global batch.

torchft is imported only here, when the flags are given: it is a client of the example, not a
dependency of shardwise (``pip install torchft==0.2.0``, which ships ``torchft_lighthouse``).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from examples.data import global_batch, inputs_and_targets, local_slice
from examples.model import LlamaConfig
from examples.optimizers import build_optimizer
from examples.parallel import build_and_shard
from examples.train_loop import data_parallel_rank, finish, mean_over_mesh, say_summary
import shardwise.checkpoint as ckpt
from shardwise.composable import FSDPModule, loss_parallel
from shardwise.mesh import data_parallel_mesh, init_distributed, init_mesh

__all__ = ["add_ft_args", "run_ft"]


def add_ft_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance across replica groups, with torchft (docs/fault_tolerance.md)")
    g.add_argument("--ft-replica-group", type=int, default=None, metavar="G",
                   help="run as replica group G (0 .. --ft-groups - 1) under torchft")
    g.add_argument("--ft-lighthouse", metavar="URL", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="the torchft_lighthouse, e.g. http://127.0.0.1:29510 (default: $TORCHFT_LIGHTHOUSE)")
    g.add_argument("--ft-groups", type=int, default=2, help="replica groups the data is split over")
    g.add_argument("--ft-min-groups", type=int, default=1, help="groups a step needs to commit")
    g.add_argument("--ft-timeout", type=float, default=60.0, help="seconds torchft waits for a quorum, "
                   "a cross-group collective or a heal")


def check_ft_args(args: argparse.Namespace) -> str | None:
    """The one-line error for bad ``--ft-*`` flags, or None."""
    if args.ft_replica_group is None:
        return None
    if not args.ft_lighthouse:
        return "--ft-replica-group needs --ft-lighthouse URL (or TORCHFT_LIGHTHOUSE): start torchft_lighthouse first"
    if not 0 <= args.ft_replica_group < args.ft_groups:
        return f"--ft-replica-group {args.ft_replica_group} is not in 0 .. --ft-groups {args.ft_groups} - 1"
    if args.batch_size % args.ft_groups:
        return f"--batch-size {args.batch_size} does not split over --ft-groups {args.ft_groups}; make it a multiple"
    if args.optimizer != "adamw" or args.save or args.resume:
        return "--ft-replica-group trains with --optimizer adamw, without --save/--resume (a group heals from its peers)"
    return None


def run_ft(args: argparse.Namespace, dp_shard: int) -> list[float]:
    """Train one replica group up to ``--steps`` (the quorum's step); return its losses."""
    try:
        import torchft as ft
        from torchft.process_group import ManagedProcessGroup
    except ImportError as e:
        raise SystemExit(f"train.py: error: --ft-replica-group needs torchft (pip install torchft==0.2.0): {e}")
    t0 = time.perf_counter()
    rank, _ = init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=dp_shard, tp=args.tp)
    dp_mesh = data_parallel_mesh(mesh)
    dp_rank, dp_size = data_parallel_rank(mesh)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    model = build_and_shard(cfg, dp_mesh, seed=args.seed, tp_mesh=mesh["tp"],
                            uneven_shards=args.seq_len % mesh["tp"].size() != 0)
    optim = build_optimizer(model, "adamw", args.lr)
    served: dict = {}

    def serve() -> None:  # taken once (and after a heal): the training updates these tensors in place
        served["model"] = ckpt.get_model_state_dict(model)
        served["optim"] = ckpt.get_optimizer_state_dict(model, optim)

    def load(sd: dict) -> None:
        ckpt.set_model_state_dict(model, sd["model"])
        ckpt.set_optimizer_state_dict(model, optim, sd["optim"])
        serve()

    timeout = timedelta(seconds=args.ft_timeout)
    pg = ft.ProcessGroupNCCL(timeout=timeout) if torch.cuda.is_available() else ft.ProcessGroupGloo(timeout=timeout)
    serve()
    manager = ft.Manager(pg=pg, min_replica_size=args.ft_min_groups, load_state_dict=load,
                         state_dict=lambda: dict(served), lighthouse_addr=args.ft_lighthouse,
                         replica_id=f"train_ft_{args.ft_replica_group}", timeout=timeout,
                         quorum_timeout=timeout, connect_timeout=timeout, init_sync=False)
    across = ManagedProcessGroup(manager)

    def average_over_groups(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=across, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(average_over_groups)
    ft_optim = ft.Optimizer(manager, optim)
    rows, slot = args.ft_groups * dp_size, args.ft_replica_group * dp_size + dp_rank
    say(f"replica group {args.ft_replica_group} of {args.ft_groups}: mesh {tuple(mesh.shape)} "
        f"{mesh.mesh_dim_names}, lighthouse {args.ft_lighthouse}")
    t1, losses, failed = time.perf_counter(), [], 0
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        ft_optim.zero_grad(set_to_none=True)  # starts the quorum (and a heal, when this group is behind)
        inputs, targets = inputs_and_targets(local_slice(
            global_batch(step, args.batch_size, args.seq_len, args.vocab, args.seed), slot, rows))
        logits = model(inputs)
        with loss_parallel() if isinstance(logits, DTensor) else torch.enable_grad():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        ft_optim.step()  # commits only if every participant succeeded
        time.sleep(args.step_delay)  # --step-delay: a longer step, time to stop and restart a group by hand
        if manager.current_step() < step:
            failed += 1
            say(f"step {step:4d}  not committed (a peer failed); retrying")
            continue
        value = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        losses.append(mean_over_mesh(value, dp_mesh).item())
        if step % args.log_every == 0 or step == args.steps or len(losses) == 1:
            say(f"step {step:4d}  loss {losses[-1]:.4f}  groups {manager.num_participants()}")
    say(f"committed {len(losses)} steps here, {failed} retried; the quorum's step is {manager.current_step()}")
    say_summary(say, losses, t0, t1, time.perf_counter())
    manager.shutdown(wait=False)
    finish(say, args, losses)
    return losses
