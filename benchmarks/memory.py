"""Peak tensor memory per rank: shardwise's strategies against torch's FSDP2 (and DDP).

    torchrun --nproc-per-node 4 benchmarks/memory.py            # 4 gloo ranks on CPU

For each (implementation, strategy) the script builds the Llama of ``examples/model.py`` from
one seed, shards it (one unit per ``TransformerBlock``, then the root), trains one untracked
AdamW step (which creates the optimizer state), then tracks ``--steps`` more steps with
`benchmarks.tracker.AllocationTracker`: peak bytes of live tensor storages, counting what
existed before (parameters, optimizer state, buffers) and every tensor made since. Rank 0
prints, per rank, the peak next to the theory

    FULL_SHARD     4P/N + U_max + A       (params + grads + 2 Adam states, sharded; the largest
    SHARD_GRAD_OP  4P/N + P + A            unit unsharded; activations)
    NO_SHARD       4P + A                  (what DDP needs)

with ``P`` the model's fp32 bytes, ``N`` the shard-axis size, ``U_max`` the bytes of the
largest unit and ``A`` the activations: the peak of one forward + loss of the unsharded model
on this rank's batch, minus its parameters (measured the same way, before sharding).

``--lora R`` fine-tunes LoRA adapters of rank ``R`` instead (PEFT's ``get_peft_model`` on every
``nn.Linear`` of the blocks, the base frozen; the PEFT model is the root unit; the optimizer is
given every parameter, as PEFT scripts do). With ``F`` the frozen base's bytes and ``L`` the
adapters' (``P = F + L``), the theory is

    FULL_SHARD     (F + 4L)/N + U_max + A   (frozen params sharded with no gradient and no Adam
    SHARD_GRAD_OP  (F + 4L)/N + P + A        state; adapters: params + grads + 2 Adam states,
    NO_SHARD       F + 4L + A                sharded; units and activations as above)

    torchrun --nproc-per-node 4 benchmarks/memory.py --lora 8 --strategies FULL_SHARD
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.tracker import AllocationTracker  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402
from shardwise.composable import ShardingPolicy, ShardingStrategy, apply_fully_shard, strategy_mesh  # noqa: E402
from shardwise.mesh import init_distributed, init_mesh  # noqa: E402

MB = 2**20
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, split over the ranks")
    p.add_argument("--steps", type=int, default=2, help="tracked steps after one untracked warm-up step")
    p.add_argument("--impls", default="shardwise,torch", help="comma list of shardwise, shardwise-limit1 (set_unshard_limit(1)), torch, "
                   "ddp (NO_SHARD only)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--lora", type=int, default=0, help="LoRA rank: fine-tune PEFT LoRA adapters on the blocks' "
                   "linear layers, the base frozen (0: train every parameter)")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    return p.parse_args(argv)


LORA_TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]  # every nn.Linear of a TransformerBlock


def build(cfg: LlamaConfig, lora: int = 0):
    """The Llama from one seed; with ``lora`` > 0 wrapped by PEFT with LoRA adapters of that rank
    on ``LORA_TARGETS`` (the base frozen, the adapters' init from one seed)."""
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=LORA_TARGETS,
                                            lora_dropout=0.0, init_lora_weights=False))


def blocks(model) -> list:
    """The TransformerBlocks of the Llama, PEFT-wrapped or not."""
    return list(getattr(model, "get_base_model", lambda: model)().layers)


def shard(model: Llama, impl: str, strategy: str, mesh):
    """Apply ``impl``'s sharding for ``strategy``; return the module to call."""
    if impl in ("shardwise", "shardwise-limit1"):
        apply_fully_shard(model, mesh, ShardingPolicy(strategy=strategy, layer_cls="TransformerBlock"))
        if impl == "shardwise-limit1":  # one unit unsharded at a time: no prefetch (as FSDP2 on CPU)
            model.set_unshard_limit(1)
        return model
    if impl == "torch":  # FSDP2 with the same mesh and reshard_after_forward as the strategy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        dp_mesh = strategy_mesh(strategy, mesh)
        raf = ShardingStrategy.parse(strategy).reshard_after_forward
        for block in blocks(model):
            torch_fully_shard(block, mesh=dp_mesh, reshard_after_forward=raf)
        torch_fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if raf else False)
        return model
    if impl == "ddp" and strategy == "NO_SHARD":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    raise ValueError(f"no {impl} run for {strategy}")


def batch(step: int, args, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
    per = args.batch_size // world
    return tokens[rank * per : (rank + 1) * per]


def train_step(model, optim, tokens, tracker=None) -> None:
    def phase(name):
        if tracker is not None:
            tracker.phase = name

    phase("forward")
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    phase("backward")
    loss.backward()
    phase("optimizer")
    optim.step()
    optim.zero_grad(set_to_none=True)
    phase("between steps")


def activation_bytes(cfg: LlamaConfig, tokens: torch.Tensor, lora: int = 0) -> int:
    """Peak of one forward + loss of the unsharded model over its parameter bytes."""
    model = build(cfg, lora)
    tracker = AllocationTracker()
    tracker.track(list(model.parameters()) + list(model.buffers()) + [tokens])
    base = tracker.current()
    with tracker:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    del loss, logits
    return tracker.peak - base


def measure(cfg, args, impl: str, strategy: str, mesh, rank: int, world: int) -> dict:
    model = shard(build(cfg, args.lora), impl, strategy, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optim, batch(0, args, rank, world))  # creates the optimizer state
    tracker = AllocationTracker()
    state = [t for s in optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker.track(list(model.parameters()) + list(model.buffers()), "params")
    tracker.track(state, "optimizer")
    with tracker:
        for step in range(1, args.steps + 1):
            train_step(model, optim, batch(step, args, rank, world), tracker)
        end = tracker.current_by_tag()
    return dict(peak=tracker.peak, phase=tracker.peak_phase, at_peak=tracker.peak_by_tag, between_steps=end)


def theory(strategy: str, P: int, N: int, U: int, A: int, L: int | None = None) -> int:
    """The module docstring's formulas; ``L``: the trainable (LoRA) bytes, ``P - L`` frozen
    (``None``: every parameter trains, ``L = P``)."""
    L = P if L is None else L
    kept = (P - L) + 4 * L  # frozen params, then trained params + grads + 2 Adam states
    if strategy == "FULL_SHARD":
        return kept // N + U + A
    if strategy == "SHARD_GRAD_OP":
        return kept // N + P + A
    return kept + A


def report(results: list[dict], info: dict) -> str:
    P, U, A = info["P"], info["U_max"], info["A"]
    lines = [f"model: {info['cfg']}",
             f"P = {P / MB:.1f} MiB fp32 params ({info['numel']:,}); units: root {info['root'] / MB:.1f} MiB, "
             f"block {info['block'] / MB:.1f} MiB (U_max {U / MB:.1f}); A = {A / MB:.1f} MiB activations/rank; "
             f"world {info['world']}"
             + (f"; LoRA rank {info['lora']}: F = {(P - info['L']) / MB:.1f} MiB frozen, L = {info['L'] / MB:.2f} MiB "
                "adapters" if info.get("lora") else ""), "",
             "| impl | strategy | peak MiB per rank (r0..r3) | peak phase | theory MiB | peak/theory | "
             "params+optim between steps MiB | vs torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["impl"], r["strategy"]): r for r in results}
    for r in results:
        N = info["world"] if r["strategy"] != "NO_SHARD" else 1
        th = theory(r["strategy"], P, N, U, A, info["L"] if info.get("lora") else None)
        peaks = [x["peak"] for x in r["ranks"]]
        between = max(sum(x["between_steps"].values()) for x in r["ranks"])
        base = by.get(("torch", r["strategy"]))
        ratio = max(peaks) / max(x["peak"] for x in base["ranks"]) if base else None
        lines.append(f"| {r['impl']} | {r['strategy']} | {' / '.join(f'{p / MB:.1f}' for p in peaks)} | "
                     f"{r['ranks'][0]['phase']} | {th / MB:.1f} | {max(peaks) / th:.2f} | {between / MB:.1f} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} |")
    lines.append("")
    lines.append("at the peak, rank 0, MiB by kind (params/optimizer: existed before tracking; new: grads, "
                 "unsharded params, activations, communication buffers):")
    for r in results:
        kinds = ", ".join(f"{k} {v / MB:.1f}" for k, v in sorted(r["ranks"][0]["at_peak"].items()))
        lines.append(f"  {r['impl']:9s} {r['strategy']:13s} {kinds}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed()
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    probe = build(cfg, args.lora)
    block = sum(p.numel() for p in blocks(probe)[0].parameters()) * 4
    total = sum(p.numel() for p in probe.parameters())
    trained = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    info = dict(cfg=str(cfg), numel=total, P=total * 4, block=block, root=total * 4 - block * cfg.n_layers,
                world=world, A=activation_bytes(cfg, batch(1, args, rank, world), args.lora), lora=args.lora,
                L=trained * 4)
    info["U_max"] = max(info["block"], info["root"])
    del probe
    mesh = init_mesh()
    results = []
    for impl in args.impls.split(","):
        for strategy in args.strategies.split(","):
            if impl == "ddp" and strategy != "NO_SHARD":
                continue
            mine = measure(cfg, args, impl, strategy, mesh, rank, world)
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
            results.append(dict(impl=impl, strategy=strategy, ranks=ranks))
            if rank == 0:
                print(f"done {impl} {strategy}: peak {max(x['peak'] for x in ranks) / MB:.1f} MiB", flush=True)
    if rank == 0:
        print(report(results, info))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(info=info, results=results, argv=sys.argv), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
