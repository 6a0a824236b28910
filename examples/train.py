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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from examples.data import global_batch, inputs_and_targets, local_slice, loss_floor  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402
from examples.parallel import apply_fsdp, apply_tp  # noqa: E402
import shardwise.checkpoint as ckpt  # noqa: E402
from shardwise.composable import loss_parallel  # noqa: E402
from shardwise.mesh import data_parallel_mesh, init_distributed, init_mesh  # noqa: E402

DP_DIMS = ("dp_replicate", "dp_shard")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh`` (the current CUDA device on GPU meshes)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def data_parallel_rank(mesh: DeviceMesh, dims: tuple[str, ...] = DP_DIMS) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: this rank's index on the flattened data-parallel axes of ``mesh``.

    Works on the full 3-D mesh or on the 1-D / 2-D data-parallel sub-mesh: the
    axes of ``mesh`` named in ``dims`` (all its axes if it has no names) are
    flattened row-major, ``dp_rank = replicate_coord * dp_shard + shard_coord``.
    Ranks that differ only in other axes (tp) get the same data.
    """
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"rank {dist.get_rank()} is not part of {mesh}")
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    axes = [i for i, n in enumerate(names) if n in dims] if mesh.mesh_dim_names else list(range(mesh.ndim))
    dp_rank, dp_size = 0, 1
    for i in axes:
        dp_rank = dp_rank * mesh.size(i) + coord[i]
        dp_size *= mesh.size(i)
    return dp_rank, dp_size


def mean_over_mesh(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Mean of ``value`` over all ranks of ``mesh`` (SUM per axis, then divide: gloo has no AVG)."""
    out = value.detach().clone()
    for i in range(mesh.ndim):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.get_group(i))
    return out / mesh.size()


def build_and_shard(
    cfg: LlamaConfig, dp_mesh: DeviceMesh, *, seed: int = 0, tp_mesh: DeviceMesh | None = None, **shard_kwargs
) -> Llama:
    """Build :class:`Llama` from ``seed`` (identical on every rank), tensor-parallelise it on
    ``tp_mesh`` when given (``apply_tp``), then shard it on ``dp_mesh`` (``apply_fsdp``: each
    block, then the root). A 2-D ``dp_mesh`` (``dp_replicate x dp_shard``) gives HSDP.
    ``shard_kwargs`` go to every ``fully_shard`` call (e.g. ``reshard_after_forward``).
    """
    model = Llama(cfg, generator=torch.Generator().manual_seed(seed))
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh)
    return apply_fsdp(model, dp_mesh, **shard_kwargs)


def app_state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    """What a checkpoint holds: the model and optimizer state keyed by parameter name (so it
    reshards like the parameters), and the step."""
    return {"model": ckpt.get_model_state_dict(model), "optim": ckpt.get_optimizer_state_dict(model, optim),
            "trainer": {"step": step}}


def resume(model: torch.nn.Module, optim: torch.optim.Optimizer, path: str) -> int:
    """Load ``path`` into ``model`` and ``optim`` (resharding to this job's layout); return the
    step it was saved at."""
    state = app_state(model, optim, 0)
    ckpt.load(state, path)
    ckpt.set_model_state_dict(model, state["model"])
    ckpt.set_optimizer_state_dict(model, optim, state["optim"])
    return int(state["trainer"]["step"])


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """``(local, full)``: bytes of parameters this rank stores, and of the unsharded model."""
    local = full = 0
    for p in model.parameters():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        full += p.numel() * p.element_size()  # a DTensor's numel is its global size
    return local, full


def train(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    steps: int = 30,
    batch_size: int = 16,
    seq_len: int = 64,
    vocab: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 5,
    log=None,
    optim: torch.optim.Optimizer | None = None,
    start_step: int = 1,
) -> list[float]:
    """Train ``model`` with AdamW (or ``optim``) for steps ``start_step .. steps``; return the
    loss of each step.

    Every rank builds the global batch of the step and keeps its data-parallel
    slice. The returned losses are the means over the data-parallel ranks (equal
    slices, so this is the global-batch loss) and are the same on every rank.
    ``log(step, loss)`` is called on the logging steps (first, every
    ``log_every``-th, last).
    """
    device = mesh_device(dp_mesh)
    dp_rank, dp_size = data_parallel_rank(dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr) if optim is None else optim
    losses: list[float] = []
    for step in range(start_step, steps + 1):
        tokens = local_slice(global_batch(step, batch_size, seq_len, vocab, seed), dp_rank, dp_size)
        inputs, targets = (t.to(device) for t in inputs_and_targets(tokens))
        logits = model(inputs)
        if isinstance(logits, DTensor):  # class-sharded logits under tensor parallelism
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        value = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        losses.append(mean_over_mesh(value, dp_mesh).item())
        if log is not None and (step == start_step or step % log_every == 0 or step == steps):
            log(step, losses[-1])
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp-replicate", type=int, default=1, help="replica groups (HSDP outer axis)")
    p.add_argument("--dp-shard", type=int, default=-1, help="ranks one copy is sharded over; -1 = the rest")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (consecutive, within a host)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention; default = --heads")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, split over the dp ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--save", metavar="DIR", help="save model + optimizer + step to DIR at the end")
    p.add_argument("--resume", metavar="DIR", help="resume from a checkpoint saved by --save (any world size)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (CPU runs only)")
    from examples.pipeline_setup import add_pipeline_args  # pipeline flags: --pp, --schedule, --microbatches

    add_pipeline_args(p)
    return p.parse_args(argv)


def resolve_dp_shard(world_size: int, dp_replicate: int, dp_shard: int, tp: int = 1) -> int:
    """Fill in ``dp_shard=-1`` and check that the mesh covers exactly ``world_size`` ranks."""
    if dp_replicate < 1 or tp < 1:
        raise ValueError("dp_replicate and tp must be >= 1")
    if dp_shard == -1:
        if world_size % (dp_replicate * tp):
            raise ValueError(f"world size {world_size} is not divisible by dp_replicate*tp={dp_replicate * tp}")
        dp_shard = world_size // (dp_replicate * tp)
    if dp_replicate * dp_shard * tp != world_size:
        raise ValueError(
            f"dp_replicate*dp_shard*tp = {dp_replicate}*{dp_shard}*{tp} != world size {world_size}"
        )
    return dp_shard


def main(argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(args.threads)
    if args.pp > 1:  # pipeline parallelism: its own loop, same data, losses and checkpoints
        from examples.pipeline_setup import run_pipeline

        return run_pipeline(args)
    t0 = time.perf_counter()
    rank, world_size = init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)

    dp_shard = resolve_dp_shard(world_size, args.dp_replicate, args.dp_shard, args.tp)
    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=dp_shard, tp=args.tp)
    dp_mesh = data_parallel_mesh(mesh)
    _, dp_size = data_parallel_rank(mesh)
    if args.batch_size % dp_size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by the dp size {dp_size}")
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
    model = build_and_shard(cfg, dp_mesh, seed=args.seed, tp_mesh=mesh["tp"])

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

    say(f"training {args.steps} steps, global batch {args.batch_size} x {args.seq_len} tokens, "
        f"{args.batch_size // dp_size} rows per dp rank; loss floor ln(branching) = {loss_floor():.3f}")
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 1
    if args.resume:
        start = resume(model, optim, args.resume) + 1
        say(f"resumed from {args.resume}: continuing at step {start} on {world_size} ranks")
    t1 = time.perf_counter()
    losses = train(
        model, dp_mesh, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        vocab=args.vocab, lr=args.lr, seed=args.seed, log_every=args.log_every,
        log=lambda step, loss: say(f"step {step:4d}  loss {loss:.4f}"), optim=optim, start_step=start,
    )
    t2 = time.perf_counter()
    if args.save:
        ckpt.save(app_state(model, optim, args.steps), args.save)
        say(f"saved step {args.steps} to {args.save} (resume with --resume {args.save}, on any world size)")
    if losses:
        say(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    say(f"time: setup {t1 - t0:.1f}s, train {t2 - t1:.1f}s ({(t2 - t1) / max(args.steps, 1) * 1e3:.0f} ms/step)")
    dist.barrier()  # nobody tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
