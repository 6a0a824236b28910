"""The training loop of ``examples/train.py``, shared by its plain, tensor-parallel, MoE and
context-parallel paths (``examples/cp.py``), and the mesh arithmetic it needs: this rank's
device, its index on the data-parallel axes (which rows of the global batch it trains on) and
the mean of a value over a mesh (the logged loss). Also the end of every path's job: the
summary lines and the final ``result:`` line (`finish`, the pipelined path's too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from examples.data import global_batch, inputs_and_targets, local_slice
from shardwise.composable import loss_parallel

__all__ = ["DP_DIMS", "mesh_device", "data_parallel_rank", "mean_over_mesh", "train", "say_summary", "finish"]

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
    data_mesh: DeviceMesh | None = None,
    batch_of: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = inputs_and_targets,
) -> list[float]:
    """Train ``model`` with AdamW (or ``optim``) for steps ``start_step .. steps``; return the
    loss of each step.

    Every rank builds the global batch of the step and keeps its data-parallel
    slice. The returned losses are the means over the data-parallel ranks (equal
    slices, so this is the global-batch loss) and are the same on every rank.
    ``log(step, loss)`` is called on the logging steps (first, every
    ``log_every``-th, last).

    ``data_mesh``: the mesh whose data-parallel axes (`DP_DIMS`) pick this rank's rows; default
    ``dp_mesh``, which the losses are averaged over (under cp, the whole mesh, while ``dp_mesh``
    is ``dp_shard`` x ``cp`` flattened). ``batch_of(tokens)``: ``(inputs, targets, *args)`` of
    this rank's rows ``[b, T + 1]``, the model called as ``model(inputs, *args)`` (default
    `inputs_and_targets`; cp: this rank's zigzag shards and their positions).
    """
    device = mesh_device(dp_mesh)
    dp_rank, dp_size = data_parallel_rank(dp_mesh if data_mesh is None else data_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=lr) if optim is None else optim
    losses: list[float] = []
    for step in range(start_step, steps + 1):
        tokens = local_slice(global_batch(step, batch_size, seq_len, vocab, seed), dp_rank, dp_size)
        inputs, targets, *args = (t.to(device) for t in batch_of(tokens))
        logits = model(inputs, *args)
        if isinstance(logits, DTensor):  # class-sharded logits under tensor parallelism
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if hasattr(model, "extra_loss"):  # e.g. an MoE model's load-balancing loss (examples/moe.py)
            loss = model.extra_loss(loss)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        value = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        losses.append(mean_over_mesh(value, dp_mesh).item())
        if log is not None and (step == start_step or step % log_every == 0 or step == steps):
            log(step, losses[-1])
    return losses


def say_summary(say, losses: list[float], t0: float, t1: float, t2: float) -> None:
    """The run's summary lines: the first and last loss, the setup time (``t0 .. t1``) and the
    training time (``t1 .. t2``, per step over the steps trained)."""
    if losses:
        say(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    say(f"time: setup {t1 - t0:.1f}s, train {t2 - t1:.1f}s "
        f"({len(losses)} steps, {(t2 - t1) / max(len(losses), 1) * 1e3:.0f} ms/step)")


def finish(say, args, losses: list[float]) -> None:
    """End a job of ``examples/train.py``, whichever path trained it: wait for every rank (nobody
    tears down its connections while a peer still uses them), print the last line,
    ``result: steps=S trained=T samples=N loss=L`` (`examples.elastic.result_line`, read back by
    `examples.elastic.parse_result`), and destroy the process group."""
    from examples.elastic import result_line

    dist.barrier()
    say(result_line(args.steps, len(losses), args.steps * args.batch_size, losses[-1] if losses else None), flush=True)
    dist.destroy_process_group()
