"""Context parallelism for ``examples/train.py``: ``--cp N`` shards each sample's sequence over
``N`` ranks in the zigzag layout (docs/context_parallel.md).

The mesh is ``init_mesh(dp_replicate, dp_shard, cp, tp)``; the model is tensor-parallelised on
``tp`` as without cp, then ``fully_shard``ed on `data_parallel_mesh` (``dp_shard`` x ``cp``
flattened, so the cp ranks' gradients are averaged with the data-parallel ones), and the SDPA
calls of its attention modules are routed to the ring (`route_attention`). Each data-parallel
rank takes its rows of the global batch as without cp; each cp rank of it keeps its zigzag
shard of the inputs and targets and passes its positions to the model (rotary tables). The
loss is the mean over the rank's tokens, every rank holding as many: the gradient average over
``dp_shard_cp`` and the logged mean over it are then the mean over all tokens of the global
batch, as with ``--cp 1``. ``--save`` / ``--resume`` work at any cp (the checkpoint has the
unsharded model's names).

The pipelined loop (``--pp``, ``examples/pipeline_setup.py``) and the elastic one
(``--checkpoint-dir``, ``examples/elastic.py``) take ``--cp`` through `CPWiring`: a few calls
that add the axis, route the attention and attach the positions there.
"""

from __future__ import annotations

import argparse
import time

import torch

import shardwise.composable as sw
from examples.data import inputs_and_targets
from examples.model import Llama, LlamaConfig
from examples.preflight import UsageError
from shardwise.mesh import cp_mesh, data_parallel_mesh, init_distributed, init_mesh

__all__ = ["add_cp_args", "cp_world", "apply_cp", "cp_shard", "train_cp", "run_cp", "CPWiring", "apply_cp_blocks"]


def add_cp_args(p: argparse.ArgumentParser) -> None:
    """The context-parallel flags of ``examples/train.py``."""
    g = p.add_argument_group("context parallelism")
    g.add_argument("--cp", type=int, default=1, help="context-parallel ranks per sample (the sequence is sharded)")
    g.add_argument("--cp-method", default="ring", choices=list(sw.METHODS), help="how keys/values cross the cp ranks")


def cp_world(args: argparse.Namespace, world: int) -> int:
    """The ranks one cp slot spans (``world // cp``), what the data-parallel layout is checked
    against; `UsageError` for a cp the job cannot have."""
    cp = getattr(args, "cp", 1)
    if cp == 1:
        return world
    if cp < 1 or world % cp:
        raise UsageError(f"--cp {cp} does not divide the world size {world}")
    if args.seq_len % (2 * cp):
        raise UsageError(f"--seq-len {args.seq_len} is not a multiple of 2 x --cp = {2 * cp} (the zigzag layout)")
    return world // cp


def apply_cp(model: Llama, cp_group, method: str = "ring") -> sw.RouteHandle:
    """Route the attention of every block to the cp ring."""
    return apply_cp_blocks(model.layers, cp_group, method)


def cp_shard(tokens: torch.Tensor, cp_rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, positions)`` of this cp rank from ``tokens [B, T + 1]``."""
    inputs, targets = inputs_and_targets(tokens)
    seq = inputs.shape[1]
    return (sw.shard_sequence(inputs, cp_rank, cp), sw.shard_sequence(targets, cp_rank, cp),
            sw.zigzag_positions(seq, cp_rank, cp))


def train_cp(model, mesh, *, steps: int, batch_size: int, seq_len: int, vocab: int, lr: float, seed: int,
             log=None, log_every: int = 5, optim: torch.optim.Optimizer | None = None,
             start_step: int = 1) -> list[float]:
    """The training loop of ``examples/train.py`` (`examples.train_loop.train`) with each
    sample's sequence sharded over ``cp``: steps ``start_step .. steps`` with AdamW (or
    ``optim``, e.g. one a checkpoint was loaded into). The rows come from the data-parallel
    axes of ``mesh``, the losses are averaged over `data_parallel_mesh` (``dp_shard`` x ``cp``)."""
    from examples.train_loop import train

    cpm = cp_mesh(mesh)
    cp_rank, cp = (cpm.get_local_rank(), cpm.size()) if cpm is not None else (0, 1)
    return train(model, data_parallel_mesh(mesh), steps=steps, batch_size=batch_size, seq_len=seq_len, vocab=vocab,
                 lr=lr, seed=seed, log=log, log_every=log_every, optim=optim, start_step=start_step, data_mesh=mesh,
                 batch_of=lambda tokens: cp_shard(tokens, cp_rank, cp))


def run_cp(args: argparse.Namespace, dp_shard: int) -> list[float]:
    """``examples/train.py`` with ``--cp > 1``: build the mesh and the model, resume (``--resume``),
    train, save (``--save``), print. Checkpoints hold the parameters and optimizer state under
    the unsharded model's names, whatever cp: one saved at ``--cp 2`` resumes at ``--cp 1`` or
    any other cp, and the other way round."""
    from examples.checkpoints import app_state, resume, save_or_rescue
    from examples.parallel import build_and_shard
    from examples.preflight import MODEL_ARGS
    from examples.train import resume_command
    from examples.train_loop import finish, say_summary

    t0 = time.perf_counter()
    rank, world_size = init_distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=dp_shard, cp=args.cp, tp=args.tp)
    dp_mesh = data_parallel_mesh(mesh)
    cpm = cp_mesh(mesh)
    say(f"world={world_size} device={mesh.device_type}")
    say(f"mesh: shape={tuple(mesh.shape)} names={mesh.mesh_dim_names} ranks={mesh.mesh.tolist()}")
    say(f"fully_shard mesh: names={dp_mesh.mesh_dim_names} (dp_shard x cp); cp {args.cp} ({args.cp_method}), "
        f"{args.seq_len // args.cp} tokens of each sample per rank")
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    model = build_and_shard(cfg, dp_mesh, seed=args.seed, tp_mesh=mesh["tp"],
                            uneven_shards=(args.seq_len // args.cp) % mesh["tp"].size() != 0)
    apply_cp(model, cpm, args.cp_method)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 1
    if args.resume:
        step, _ = resume(model, optim, args.resume)
        start = step + 1
        say(f"loaded step {step} from {args.resume}; training steps {start}..{args.steps}")
    t1 = time.perf_counter()
    losses = train_cp(model, mesh, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      vocab=args.vocab, lr=args.lr, seed=args.seed, log_every=args.log_every,
                      log=lambda step, loss: say(f"step {step:4d}  loss {loss:.4f}"), optim=optim, start_step=start)
    say_summary(say, losses, t0, t1, time.perf_counter())
    if args.save:
        state = app_state(model, optim, args.steps, {name: getattr(args, name) for name in MODEL_ARGS})
        where = save_or_rescue(state, args.save, say)
        say(f"saved step {args.steps} to {where}; resume (at any --cp) with: "
            f"{resume_command(args, world_size, where, 2 * args.steps)}")
    finish(say, args, losses)
    return losses


class CPWiring:
    """``--cp`` inside the loops that do not call the model with positions themselves: the
    pipelined job (``examples/pipeline_setup.run_pipeline``) and the elastic one
    (``examples/elastic.run_elastic``), in a few calls that do nothing at ``--cp 1``. The mesh gets
    a ``cp`` axis (``init_mesh(..., cp=self.cp)``); `shard_mesh` gives the mesh to
    ``fully_shard`` on (``dp_shard_cp``: the cp ranks of a stage hold the same weights, their
    gradients are averaged with the data-parallel ones); `wire` (pipeline stages) or
    `wire_model` (a whole model) routes the attention to the cp group and attaches this rank's
    zigzag positions to every call (`feed_positions`: a pipeline schedule passes each stage only
    the microbatch's inputs, a later stage's hidden state comes from the previous stage, and
    the positions are the same for every microbatch); `shard` keeps this rank's zigzag shard of
    a step's inputs and targets. Each (micro)batch loss is the mean over the rank's tokens, equal
    in number on every cp rank, so the gradient average over ``dp_shard_cp`` and the logged mean
    over it are the mean over all tokens of the global sequence."""

    def __init__(self, cp: int = 1, method: str = "ring") -> None:
        self.cp, self.method = cp, method
        self.rank = 0
        self.handles: list = []

    @classmethod
    def of(cls, args: argparse.Namespace) -> "CPWiring":
        return cls(getattr(args, "cp", 1), getattr(args, "cp_method", "ring"))

    def shard_mesh(self, mesh, dp_mesh):
        """The mesh to ``fully_shard`` the stages on and average the losses over: ``dp_mesh``
        itself at cp 1, else `data_parallel_mesh` (``dp_shard`` x ``cp`` flattened)."""
        if self.cp == 1:
            return dp_mesh
        self.rank = cp_mesh(mesh).get_local_rank()
        return data_parallel_mesh(mesh)

    def wire(self, split, mesh, seq_len: int, device) -> None:
        """Route the attention of this rank's stages to the cp ring and feed every stage shell
        this rank's positions (call after ``fully_shard``)."""
        if self.cp == 1:
            return
        self.rank = cp_mesh(mesh).get_local_rank()
        blocks = [blk for st in split.stages for blk in st.blocks]
        self.handles.append(apply_cp_blocks(blocks, cp_mesh(mesh), self.method))
        pos = sw.zigzag_positions(seq_len, self.rank, self.cp).to(device)
        self.handles.append(sw.feed_positions([st.module for st in split.stages], pos))

    def wire_model(self, model: Llama, mesh, seq_len: int, device) -> None:
        """Route ``model``'s attention to the cp ring and feed it this rank's positions."""
        if self.cp == 1:
            return
        self.rank = cp_mesh(mesh).get_local_rank()
        self.handles.append(apply_cp(model, cp_mesh(mesh), self.method))
        self.handles.append(sw.feed_positions(model, sw.zigzag_positions(seq_len, self.rank, self.cp).to(device)))

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's zigzag shard of ``[B, T]`` inputs and targets (both unchanged at cp 1)."""
        if self.cp == 1:
            return inputs, targets
        return sw.shard_sequence(inputs, self.rank, self.cp), sw.shard_sequence(targets, self.rank, self.cp)


def apply_cp_blocks(blocks, cp_group, method: str = "ring") -> sw.RouteHandle:
    """Route the attention of ``blocks`` (``TransformerBlock``s) to the cp ring."""
    return sw.route_attention([block.attention for block in blocks], cp_group, method=method)
