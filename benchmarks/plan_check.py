"""``plan_memory``'s estimate against the measured peak per rank, on 1, 2 and 4 gloo ranks.

    python benchmarks/plan_check.py --ranks 1 2 4

For each world size and strategy the ranks build the Llama of ``examples/model.py`` (default
vocabulary 4001, so the embedding and output head split unevenly), shard it with
``apply_fully_shard`` (one unit per ``TransformerBlock``, then the root), train one untracked
AdamW step (creating the optimizer state), then track two steps with
`benchmarks.tracker.AllocationTracker` (live tensor storages, not RSS). The estimate is
``plan_memory(model, mesh, strategy, activation_bytes=A)`` where ``A`` is measured once, the same
way, as the peak of one forward + loss of the unsharded model on one rank's batch minus its
parameters. Every rank trains on ``--batch-per-rank`` sequences, so ``A`` does not depend on
the world size. Reported: the largest peak over ranks against ``plan.peak`` (and
``plan.upper_bound``), and rank 0's bytes between steps against ``plan.between_steps``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks`, `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.tracker import AllocationTracker  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402

MB = 2**20


def batch(step: int, args, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch_per_rank, args.seq_len + 1), generator=g)


def step(model, optim, tokens, tracker=None) -> None:
    def phase(name):
        if tracker is not None:
            tracker.phase = name

    phase("forward")
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    phase("backward")
    loss.backward()
    phase("optimizer")
    optim.step()
    optim.zero_grad(set_to_none=True)


def activations(cfg: LlamaConfig, tokens: torch.Tensor) -> int:
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    tracker = AllocationTracker()
    tracker.track(list(model.parameters()) + list(model.buffers()) + [tokens])
    base = tracker.current()
    with tracker:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    return tracker.peak - base


def measure(rank: int, world: int, cfg: LlamaConfig, strategy: str, mesh_shape: tuple[int, int], args) -> dict:
    from shardwise.composable import ShardingPolicy, apply_fully_shard
    from shardwise.mesh import init_mesh

    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    apply_fully_shard(model, init_mesh(dp_replicate=mesh_shape[0], dp_shard=mesh_shape[1], device_type="cpu"),
                      ShardingPolicy(strategy=strategy, layer_cls="TransformerBlock"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, optim, batch(0, args, rank))
    tracker = AllocationTracker()
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.track(list(model.parameters()) + list(model.buffers()) + state)
    between = tracker.current()
    with tracker:
        for i in (1, 2):
            step(model, optim, batch(i, args, rank), tracker)
    return dict(peak=tracker.peak, between=between, phase=tracker.peak_phase)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    add_model_args(p)
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The Llama's size and each rank's batch (also used by ``plan_check_pp.py``)."""
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4001)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=2)


def model_and_activations(args) -> tuple[LlamaConfig, torch.nn.Module, int]:
    """The config, the model on the meta device, and its measured activations ``A``."""
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    A = activations(cfg, batch(1, args, 0))
    with torch.device("meta"):
        meta = Llama(cfg)
    return cfg, meta, A


def layouts(world: int) -> list[tuple[str, tuple[int, int]]]:
    out = [("FULL_SHARD", (1, world)), ("SHARD_GRAD_OP", (1, world))]
    if world >= 4:
        out.append(("HYBRID_SHARD", (2, world // 2)))
    if world >= 2:
        out.append(("NO_SHARD", (world, 1)))
    return out


def main(argv=None) -> None:
    from benchmarks import plan_check as this  # ranks import the function by module name
    from shardwise.composable import plan_memory
    from tests._dist import run_ranks

    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg, meta, A = model_and_activations(args)
    n = sum(p.numel() for p in meta.parameters())
    print(f"model: {cfg}\n{n:,} params ({n * 4 / MB:.1f} MiB fp32); {args.batch_per_rank} x {args.seq_len} tokens "
          f"per rank; measured activations A = {A / MB:.1f} MiB; torch {torch.__version__}\n")
    print("| ranks | strategy (mesh) | measured peak MiB (max over ranks), in | plan.peak (start / end of backward) | "
          "error | plan.upper_bound | between steps, rank 0 | plan.between_steps |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for world in args.ranks:
        for strategy, shape in layouts(world):
            got = run_ranks(this.measure, world, cfg, strategy, shape, args, timeout=600)
            plan = plan_memory(meta, shape, strategy, activation_bytes=A)
            top = max(got, key=lambda r: r["peak"])
            peak = top["peak"]
            print(f"| {world} | {strategy} {shape} | {peak / MB:.1f}, {top['phase']} | {plan.peak / MB:.1f} "
                  f"({plan.start_of_backward / MB:.1f} / {plan.end_of_backward / MB:.1f}) | "
                  f"{(plan.peak - peak) / peak:+.1%} | {plan.upper_bound / MB:.1f} | {got[0]['between'] / MB:.2f} | "
                  f"{plan.between_steps / MB:.2f} |", flush=True)


if __name__ == "__main__":
    main()
