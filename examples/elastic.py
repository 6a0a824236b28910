"""Elastic training for ``examples/train.py``: resume by itself, at whatever world size it gets.

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/train.py --checkpoint-dir ckpt --checkpoint-every 10

With ``--checkpoint-dir DIR`` the script (``run_elastic``):

1. starts the process group with ``--collective-timeout`` and a heartbeat
   (``--heartbeat-timeout``, ``--heartbeat-interval``; `shardwise.checkpoint.start_heartbeat`), so a dead
   or frozen peer makes every rank exit promptly with status 75 and torchrun restarts the group;
2. loads the newest complete checkpoint of DIR (`shardwise.checkpoint.latest_checkpoint`:
   the series record, never a save still being written) at this world size: model, optimizer,
   RNG states and the data position (`ElasticSampler` over `WalkDataset`, global batch
   ``--batch-size`` kept at every data-parallel size);
3. trains up to ``--steps``, saving ``DIR/step-<s>`` every ``--checkpoint-every`` steps with
   ``async_save_training_state`` (committed one step later, so training is not held while files
   are written; the previous checkpoint stays the latest until the new one is complete;
   ``--keep-last`` are kept), and the last step synchronously;
4. prints the result line (`result_line`).

``--event-log FILE`` appends one JSON line per event (rank 0): ``start``, ``ready`` (process
group up), ``loaded``, ``step`` (loss, world size, the global batch's sample indices),
``saved``, ``error`` (any rank), ``result``; the elastic test and ``benchmarks/elastic.py``
read it. See docs/elastic.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from examples.data import DEFAULT_BRANCHING, inputs_and_targets, successor_table
import shardwise.checkpoint as ckpt
from shardwise.composable import loss_parallel
from shardwise.checkpoint import HeartbeatPolicy, exit_for_restart, start_heartbeat
from shardwise.mesh import data_parallel_mesh, init_distributed, init_mesh

__all__ = ["WalkDataset", "add_elastic_args", "result_line", "parse_result", "run_elastic"]

_SALT = 0x5A3F_17


class WalkDataset(Dataset):
    """``size`` walks on the Markov chain of :mod:`examples.data`: sample ``i`` is
    ``{"index": i, "tokens": [seq_len + 1]}``, fixed by ``seed`` and ``i`` alone."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int, branching: int = DEFAULT_BRANCHING) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed
        self.table = successor_table(vocab, seed, branching)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} of a WalkDataset of {self.size}")
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + _SALT) * 7919 + i)
        first = torch.randint(self.vocab, (1,), generator=g)
        choice = torch.randint(self.table.shape[1], (self.seq_len,), generator=g)
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long)
        tokens[0] = first[0]
        for t in range(self.seq_len):
            tokens[t + 1] = self.table[tokens[t], choice[t]]
        return {"index": i, "tokens": tokens}


def add_elastic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("elastic training (docs/elastic.md)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="resume from the newest complete checkpoint in DIR (any "
                   "world size) and save DIR/step-<s> every --checkpoint-every steps; data from a WalkDataset")
    g.add_argument("--checkpoint-every", type=int, default=10, metavar="K", help="steps between checkpoints "
                   "(async save; a failure loses at most the steps since the last committed one)")
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in --checkpoint-dir")
    g.add_argument("--dataset-size", type=int, default=4096, help="samples in the WalkDataset (an epoch)")
    g.add_argument("--micro-batch", type=int, default=None, help="samples per rank per forward; the gradient "
                   "accumulation steps keep --batch-size at every world size (None: batch / dp size at once)")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds without a peer's heartbeat "
                   "before every rank exits (status 75) for torchrun to restart; 0 = no heartbeat")
    g.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats")
    g.add_argument("--collective-timeout", type=float, default=600.0, help="process-group timeout in seconds: "
                   "the bound on a collective that hangs while every peer is alive")
    g.add_argument("--event-log", metavar="FILE", help="append JSON lines of events (start, step, saved, ...)")
    g.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step (tests and "
                   "benchmarks: stands for a longer step, so that a failure can land mid-run)")


def result_line(steps: int, trained: int, samples: int, loss: float | None) -> str:
    """The last line of ``examples/train.py``: ``result: steps=S trained=T samples=N loss=L``
    (``loss`` as Python's ``repr``, exact; ``nan`` when no step was ever trained)."""
    return f"result: steps={steps} trained={trained} samples={samples} loss={loss!r}".replace("None", "nan")


def parse_result(text: str) -> dict[str, float]:
    """The fields of the last ``result:`` line of ``text`` (ints as floats)."""
    line = [ln for ln in text.splitlines() if ln.startswith("result: ")][-1]
    return {k: float(v) for k, v in (kv.split("=", 1) for kv in line[len("result: "):].split())}


class _Events:
    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank = path, rank

    def __call__(self, event: str, *, all_ranks: bool = False, **fields: Any) -> None:
        if self.path and (self.rank == 0 or all_ranks):
            line = json.dumps({"event": event, "t": time.time(), "rank": self.rank, **fields})
            with open(self.path, "a") as f:
                f.write(line + "\n")


def _loss(model: torch.nn.Module, tokens: torch.Tensor, shard=None) -> torch.Tensor:
    inputs, targets = inputs_and_targets(tokens)
    if shard is not None:  # --cp: this rank's zigzag shard of the sequence (examples/cp.py)
        inputs, targets = shard(inputs, targets)
    logits = model(inputs)
    if isinstance(logits, DTensor):
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _batches(loader: ckpt.ElasticLoader):
    while True:  # epoch after epoch: the sampler moves to the next epoch by itself
        yield from loader


def run_elastic(args: argparse.Namespace, dp_shard: int) -> list[float]:
    """Train as described in the module docstring; returns this run's losses (global batch means)."""
    from examples.model import LlamaConfig
    from examples.train import _fail, build_and_shard, mean_over_mesh, mesh_device

    if args.resume or args.save or args.pp > 1:
        _fail("--checkpoint-dir resumes and saves by itself; drop --resume / --save (and --pp: not supported here)")
    if args.checkpoint_every < 1 or args.keep_last < 1:
        _fail("--checkpoint-every and --keep-last must be >= 1")
    events = _Events(args.event_log, int(os.environ.get("RANK", "0")))
    events("start", world=int(os.environ.get("WORLD_SIZE", "1")), pid=os.getpid(),
           restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    rank, world = init_distributed(timeout_s=args.collective_timeout)
    say = print if rank == 0 else (lambda *a, **k: None)
    hb = None
    if args.heartbeat_timeout > 0 and world > 1:
        def dead(message: str) -> None:
            events("dead", all_ranks=True, error=message)
            exit_for_restart(message)

        hb = start_heartbeat(HeartbeatPolicy(args.heartbeat_interval, args.heartbeat_timeout), on_dead=dead)
    from examples.cp import CPWiring  # --cp: the sequence sharded over cp ranks (examples/cp.py)

    cpx = CPWiring.of(args)
    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=dp_shard, tp=args.tp, cp=cpx.cp)
    dp_mesh = data_parallel_mesh(mesh)
    events("ready", world=world)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    model = build_and_shard(cfg, dp_mesh, seed=args.seed, tp_mesh=mesh["tp"],
                            uneven_shards=(args.seq_len // cpx.cp) % mesh["tp"].size() != 0)
    cpx.wire_model(model, mesh, args.seq_len, mesh_device(mesh))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = WalkDataset(args.dataset_size, args.seq_len, args.vocab, args.seed)
    try:
        sampler = ckpt.ElasticSampler(dataset, args.batch_size, mesh=mesh, seed=args.seed, micro_batch=args.micro_batch)
    except ValueError as e:
        _fail(f"--batch-size / --micro-batch: {e}")
    loader = ckpt.ElasticLoader(dataset, sampler)
    where = [ckpt.latest_checkpoint(args.checkpoint_dir) if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    start, last_loss = 1, None
    if where[0] is not None:
        tl = time.perf_counter()
        ts = ckpt.load_training_state(where[0], model, optim, data=sampler)
        start, last_loss = int(ts.step) + 1, ts.extra.get("loss")
        say(f"resumed from {where[0]} (step {ts.step}, saved by {ts.saved_world_size} ranks) on {world} ranks in "
            f"{time.perf_counter() - tl:.2f}s; epoch {sampler.epoch}, {sampler.consumed} samples into it")
        events("loaded", step=ts.step, world=world, saved_world=ts.saved_world_size, path=where[0])
    plan = sampler.plan
    say(f"elastic: world {world}, dp size {plan.dp_size}, global batch {plan.global_batch} = {plan.dp_size} x "
        f"{plan.micro_batch} x {plan.accumulation} accumulation; steps {start}..{args.steps}")
    device, losses = mesh_device(mesh), []
    handle: ckpt.SaveHandle | None = None
    pending_step = None
    batches = _batches(loader)

    def save(step: int, background: bool) -> Any:
        extra = {"loss": losses[-1] if losses else last_loss}
        path = os.path.join(args.checkpoint_dir, f"step-{step}")
        fn = ckpt.async_save_training_state if background else ckpt.save_training_state
        return fn(path, model, optim, step=step, extra=extra, data=sampler, keep_last=args.keep_last)

    try:
        for step in range(start, args.steps + 1):
            optim.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            mine: list[int] = []
            for _ in range(plan.accumulation):
                micro = next(batches)
                mine += micro["index"].tolist()
                loss = _loss(model, micro["tokens"].to(device), cpx.shard)
                (loss / plan.accumulation).backward()
                value = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
                total += value / plan.accumulation
            optim.step()
            losses.append(mean_over_mesh(total, dp_mesh).item())
            if args.event_log:
                parts: list[Any] = [None] * world
                dist.all_gather_object(parts, (sampler.dp_rank, mine))
                samples = [i for _, got in sorted(dict(parts).items()) for i in got]
                events("step", step=step, loss=losses[-1], world=world, samples=samples)
            if step == start or step % args.log_every == 0 or step == args.steps:
                say(f"step {step:4d}  loss {losses[-1]:.4f}")
            if handle is not None:  # commit the previous step's async save: its files were written meanwhile
                handle.wait()
                events("saved", step=pending_step, world=world)
                handle = None
            if step % args.checkpoint_every == 0 and step != args.steps:
                handle, pending_step = save(step, True), step
            if args.step_delay:
                time.sleep(args.step_delay)
        if handle is not None:
            handle.wait()
        if start <= args.steps:
            save(args.steps, False)
            events("saved", step=args.steps, world=world)
    except Exception as e:  # a peer died mid-collective (gloo "Connection closed by peer"), a failed save, ...
        events("error", all_ranks=True, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if world > 1 and os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun: exit now for the restart (an
            traceback.print_exc()  # interpreter exit would first tear down the broken process group, seconds)
            sys.stderr.flush()
            os._exit(1)
        raise
    final = losses[-1] if losses else last_loss
    line = result_line(args.steps, len(losses), sampler.samples_seen, final)
    events("result", line=line)
    if hb is not None:
        hb.stop()
    dist.barrier()
    say(line, flush=True)
    dist.destroy_process_group()
    return losses
