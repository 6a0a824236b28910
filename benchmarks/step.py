"""Training-step time and bytes communicated: shardwise against torch's FSDP2 (and DDP).

    python benchmarks/step.py --ranks 2 4 --reps 15       # gloo ranks on CPU, one thread each
    python benchmarks/step.py --ranks 4 --layouts DDP,NO_SHARD --phases 10   # + CPU time by phase

For every layout the ranks build the Llama of ``examples/model.py`` twice from one seed, shard
one copy with shardwise and the other with the torch baseline using the same mesh and
``reshard_after_forward``, and train both with AdamW on the same batches (``examples/data.py``):

    layout          shardwise                                   baseline
    FSDP            fully_shard, 1-D mesh of W                  torch fully_shard, same mesh
    HSDP            fully_shard, 2-D mesh (2, W/2)              torch fully_shard, same mesh
    SHARD_GRAD_OP   fully_shard(reshard_after_forward=False)    torch, same flag
    FSDPxTP         parallelize_module (tp 2) + fully_shard     torch's parallelize_module + fully_shard
    DDP             apply_fully_shard NO_SHARD (replicate)      DistributedDataParallel
    NO_SHARD        fully_shard NO_SHARD, (W, 1) mesh           torch fully_shard, same mesh (opt-in)
    FSDP_COMPILE    FSDP + torch.compile(model, fullgraph=True) torch fully_shard + block.compile() (opt-in;
                    (the traced unit: docs/compile.md)          --compile-backend, default inductor)
    FSDP_FLOAT8     torchao float8 + fully_shard, 1-D mesh      torch fully_shard, same (opt-in, torchao)

After two warm-up steps each, one step per implementation runs under
`benchmarks._comm_count.CommCounter`, then ``--reps`` repetitions of ``--steps`` timed steps
alternate between the two (A B, B A, A B, ...) in the same process group, so both see the same
machine load. A repetition's time is rank 0's wall time between two barriers over its steps;
its CPU time the process CPU time (all threads: compute and gloo) summed over the ranks, which
other load on the machine disturbs less. Reported: the median step time of each, the median of
the per-repetition ratios shardwise / baseline (with min and max), the median CPU time, and
the bytes one rank sends per step. ``--phases N`` then also runs ``N`` steps of each with rank
0's CPU time split into forward + loss, backward and optimizer step.

The compute-only floor: the same per-rank batch (rank 0's slice of each global batch) on one
process with one thread, as each rank has, with no sharding and no process group: the plain
model and AdamW, two warm-up steps, then ``--reps`` x ``--steps`` timed steps (`floor`).
Reported per layout: the floor's median step time and CPU time, and each implementation's step
as a ratio of it (wall: median step / floor step; CPU: all ranks' CPU time per step / (ranks x
the floor's)). What a ratio has above 1 is sharding's cost: communication, the sharded
bookkeeping, and load from the other ranks on the same cores. Under tensor parallelism a rank
computes a part of each layer, so its ratio can fall below 1.

Theoretical minimum bytes sent per rank and step (ring algorithms, see ``_comm_count``),
with ``U_i`` the bytes of unit ``i`` (each parameter padded to ``ceil(rows / S)`` rows per
rank), ``P = sum U_i``, ``U_root`` the root unit, shard axis ``S``, replicas ``R``:

    FSDP / HSDP      all-gather (S-1)/S (2P - U_root)   forward every unit, backward every
                                                        unit but the root (kept unsharded)
                     reduce-scatter (S-1)/S P
                     all-reduce 2 (R-1)/R P/S           (HSDP only: the reduced shards)
    SHARD_GRAD_OP    all-gather (S-1)/S P, reduce-scatter (S-1)/S P
    DDP / NO_SHARD   all-reduce 2 (W-1)/W P
    FSDPxTP          the FSDP terms with TP-local unit sizes over the dp axis, plus tensor
                     parallelism's activations: Megatron's minimum is 2 all-reduces in forward
                     and 2 in backward per block, of [b, T, D] each (b rows per dp rank).
    FSDP_FLOAT8      the FSDP terms, the all-gather's with the blocks' float8 weights at 1 byte
                     an element (``G_i`` instead of ``U_i``), plus the scales' all-reduce:
                     2 (S-1)/S 4 n for the n float8 weights (precompute_float8_dynamic_scale_for_fsdp)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks`, `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._comm_count import CommCounter, ring_sent  # noqa: E402
from benchmarks._step_setup import (DEFAULT_LAYOUTS, LAYOUTS, Layout, after_step, build, is_float8_linear,  # noqa: E402
                                    unit_bytes)
from examples.data import global_batch, inputs_and_targets, local_slice  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402

MB = 2**20


def theory(layout: Layout, blocks: list[int], root: int, world: int, tokens_per_rank: int,
           dim: int, gathered_units: tuple[list[int], int] | None = None, n_float8: int = 0) -> dict[str, float]:
    """Minimum bytes one rank sends per step, by collective kind (module docstring).
    ``gathered_units``: the units' bytes as all-gathered when they differ (FSDP_FLOAT8)."""
    S = 1 if layout.no_shard else world // (layout.replicate * layout.tp)
    R = world if layout.no_shard else layout.replicate
    P = sum(blocks) + root
    g_blocks, g_root = gathered_units or (blocks, root)
    gathered = sum(g_blocks) + g_root + (sum(g_blocks) if layout.reshard_after_forward else 0)
    out = {"all_gather": ring_sent("all_gather", S, gathered), "reduce_scatter": ring_sent("reduce_scatter", S, P),
           "all_reduce": ring_sent("all_reduce", R, P / S) + ring_sent("all_reduce", S, 4 * n_float8)}
    if layout.tp > 1:
        out["all_reduce"] += 4 * len(blocks) * ring_sent("all_reduce", layout.tp, tokens_per_rank * dim * 4)
    return {k: v for k, v in out.items() if v}


def _barrier_time() -> float:
    dist.barrier()
    return time.perf_counter()


def _step(model, optim, batch, layout: Layout | None = None) -> float:
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    if layout is not None:
        after_step(layout, model)
    return loss.item()


def _phases(model, optim, batches, n: int) -> dict[str, float]:
    """Mean CPU seconds of this process in forward + loss, backward and the optimizer step."""
    out = dict(forward=0.0, backward=0.0, optimizer=0.0)
    for k in range(n):
        inputs, targets = batches[k % len(batches)]
        t0 = time.process_time()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        t1 = time.process_time()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.process_time()
        optim.step()
        for name, dt in zip(out, (t1 - t0, t2 - t1, time.process_time() - t2)):
            out[name] += dt / n
    return out


def floor(cfg: LlamaConfig, dp_size: int, args) -> tuple[float, float]:
    """The compute-only floor (module docstring): median (wall, CPU) seconds of one step of the
    unsharded model, one thread, on rank 0's slice of the batches of ``dp_size`` data-parallel ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Llama(cfg, generator=torch.Generator().manual_seed(0))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = [inputs_and_targets(local_slice(global_batch(i, args.batch_size, args.seq_len, cfg.vocab_size, 0),
                                                  0, dp_size)) for i in range(2 + args.reps * args.steps)]
        for b in batches[:2]:
            _step(model, optim, b)
        wall, cpu = [], []
        for rep in range(args.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            for k in range(args.steps):
                _step(model, optim, batches[2 + rep * args.steps + k])
            wall.append((time.perf_counter() - t0) / args.steps)
            cpu.append((time.process_time() - c0) / args.steps)
        return statistics.median(wall), statistics.median(cpu)
    finally:
        torch.set_num_threads(threads)


def floor_table(results: list[dict], floors: dict[int, tuple[float, float]]) -> str:
    """Each layout's step as a ratio of the compute-only floor of its per-rank batch."""
    med = statistics.median
    rows = ["compute-only floor: the same per-rank batch on one process, one thread, no sharding; "
            "a layout's step over it (above 1: sharding's cost)",
            "| ranks | layout | rows per rank | floor ms | floor CPU ms | step / floor: shardwise | baseline | "
            "CPU / (ranks x floor CPU): shardwise | baseline |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        wall, cpu = floors[r["dp"]]
        t, c = ({i: med(r[k][i]) for i in ("shardwise", "baseline")} for k in ("times", "cpu"))
        rows.append(f"| {r['world']} | {r['layout']} | {r['rows']} | {wall * 1e3:.0f} | {cpu * 1e3:.0f} | "
                    f"**{t['shardwise'] / wall:.2f}** | {t['baseline'] / wall:.2f} | "
                    f"{c['shardwise'] / (r['world'] * cpu):.2f} | {c['baseline'] / (r['world'] * cpu):.2f} |")
    return "\n".join(rows)


def run_layout(cfg: LlamaConfig, layout: Layout, args, world: int) -> dict:
    """Every rank: warm up, count, then time interleaved repetitions. Returns rank 0's view."""
    from examples.train import data_parallel_rank
    from shardwise.mesh import init_mesh

    mesh = init_mesh(dp_replicate=layout.replicate, dp_shard=-1, tp=layout.tp, device_type="cpu")
    dp_rank, dp_size = data_parallel_rank(mesh)
    n_steps = 3 + args.reps * args.steps
    batches = [inputs_and_targets(local_slice(global_batch(i, args.batch_size, args.seq_len, cfg.vocab_size, 0),
                                              dp_rank, dp_size)) for i in range(n_steps)]
    impls = ("shardwise", "baseline")
    models = {i: build(cfg, layout, i, mesh) for i in impls}
    optims = {i: torch.optim.AdamW(models[i].parameters(), lr=1e-3) for i in impls}
    losses = {i: [] for i in impls}
    comm = {}
    first = {}
    for i in impls:
        for b in batches[:2]:
            t0 = _barrier_time()
            losses[i].append(_step(models[i], optims[i], b, layout))
            first.setdefault(i, _barrier_time() - t0)  # the first step: compiles under FSDP_COMPILE
        counter = CommCounter()
        if layout.compile and i == "shardwise":  # dynamo compiles nothing under a dispatch mode: the
            losses[i].append(_step(models[i], optims[i], batches[2], layout))  # graphs' collectives are
            comm[i] = {}  # counted in tests/test_compile_fullgraph.py instead
            continue
        with counter:
            losses[i].append(_step(models[i], optims[i], batches[2], layout))
        comm[i] = counter.by_kind()
    times, cpu = {i: [] for i in impls}, torch.zeros(len(impls), args.reps, dtype=torch.float64)
    for rep in range(args.reps):
        for i in impls if rep % 2 == 0 else impls[::-1]:
            t0 = _barrier_time()
            c0 = time.process_time()
            for k in range(args.steps):
                losses[i].append(_step(models[i], optims[i], batches[3 + rep * args.steps + k], layout))
            cpu[impls.index(i), rep] = (time.process_time() - c0) / args.steps
            times[i].append((_barrier_time() - t0) / args.steps)
    dist.all_reduce(cpu)  # CPU seconds per step, summed over ranks (all threads: compute and gloo)
    phases = {i: _phases(models[i], optims[i], batches, args.phases) for i in impls} if args.phases else None
    shard = 1 if layout.no_shard else world // (layout.replicate * layout.tp)
    blocks, root = unit_bytes(cfg, layout, mesh, shard)
    gathered = unit_bytes(cfg, layout, mesh, shard, gathered=True) if layout.float8 else None
    n_float8 = sum(is_float8_linear(m, n) for n, m in Llama(cfg).named_modules()) if layout.float8 else 0
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["shardwise"], losses["baseline"]))
    tokens = args.batch_size // dp_size * args.seq_len
    return dict(layout=layout.name, baseline=layout.baseline, world=world, times=times, comm=comm,
                cpu={i: cpu[n].tolist() for n, i in enumerate(impls)}, phases=phases,
                theory=theory(layout, blocks, root, world, tokens, cfg.dim, gathered, n_float8), loss_rel_diff=diff,
                mesh=f"({world}, 1)" if layout.no_shard else str(tuple(mesh.shape)), P=sum(blocks) + root,
                dp=dp_size, rows=len(batches[0][0]), first=first)


def rank_main(rank: int, world: int, cfg: LlamaConfig, layouts: list[str], args) -> list[dict]:
    import torch._dynamo  # noqa: F401  DTensor imports it lazily; load it before timing

    from benchmarks import _step_setup
    _step_setup.COMPILE_BACKEND = args.compile_backend

    out = []
    for name in layouts:
        layout = LAYOUTS[name]
        if layout.applies(world):
            out.append(run_layout(cfg, layout, args, world))
            if rank == 0:
                print(f"  done {name} on {world} ranks", file=sys.stderr, flush=True)
    return out


def table(results: list[dict]) -> str:
    rows = ["| ranks | layout (mesh) | baseline | step ms: shardwise | baseline | shardwise / baseline "
            "(median [min, max]) | CPU s/step, all ranks: shardwise / baseline | sent MiB/rank/step: shardwise | "
            "baseline | theory | loss rel. diff |",
            "| ---: | --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    med = statistics.median
    for r in results:
        t_sw, t_b = r["times"]["shardwise"], r["times"]["baseline"]
        ratios = [a / b for a, b in zip(t_sw, t_b)]
        c_sw, c_b = r["cpu"]["shardwise"], r["cpu"]["baseline"]
        sent = {i: f"{sum(b for _, b in r['comm'][i].values()) / MB:.2f}" if r["comm"][i] else "n/a" for i in r["comm"]}
        rows.append(f"| {r['world']} | {r['layout']} {r['mesh']} | {r['baseline']} | {med(t_sw) * 1e3:.0f} | "
                    f"{med(t_b) * 1e3:.0f} | **{med(ratios):.3f}** [{min(ratios):.2f}, {max(ratios):.2f}] | "
                    f"{med(c_sw):.2f} / {med(c_b):.2f} = {med([a / b for a, b in zip(c_sw, c_b)]):.3f} | "
                    f"{sent['shardwise']} | {sent['baseline']} | {sum(r['theory'].values()) / MB:.2f} | "
                    f"{r['loss_rel_diff']:.1e} |")
    rows += ["", "collectives per step (calls, MiB sent per rank) by kind:"]
    for r in results:
        parts = []
        for i in ("shardwise", "baseline"):
            kinds = ", ".join(f"{k} {n} x / {b / MB:.2f}" for k, (n, b) in r["comm"][i].items())
            parts.append(f"{i}: {kinds}")
        th = ", ".join(f"{k} {b / MB:.2f}" for k, b in r["theory"].items())
        rows.append(f"  {r['world']} ranks {r['layout']:13s} " + " | ".join(parts) + f" | theory: {th}")
    rows += ["", "first step (compile under FSDP_COMPILE), s: " + "; ".join(
        f"{r['world']} ranks {r['layout']} shardwise {r['first']['shardwise']:.1f} / baseline {r['first']['baseline']:.1f}"
        for r in results)]
    if any(r["phases"] for r in results):
        rows += ["", "CPU ms per step on rank 0 by phase (forward + loss / backward / optimizer step):"]
        for r in (r for r in results if r["phases"]):
            cells = [f"{i} " + " / ".join(f"{v * 1e3:.1f}" for v in r["phases"][i].values()) for i in r["phases"]]
            rows.append(f"  {r['world']} ranks {r['layout']:13s} " + " | ".join(cells) + f" (baseline: {r['baseline']})")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run, one launch each")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions per implementation")
    p.add_argument("--steps", type=int, default=1, help="timed steps per repetition")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, split over the dp ranks")
    p.add_argument("--phases", type=int, default=0, help="also time N steps by phase (CPU time, rank 0)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per launch")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of FSDP_COMPILE")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from benchmarks import step as this  # the ranks import the rank function by module name
    from tests._dist import run_ranks

    args = parse_args(argv)
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=max(args.seq_len, LlamaConfig.max_seq_len))
    n = sum(p.numel() for p in Llama(cfg).parameters())
    print(f"model: {cfg}\n{n:,} parameters ({n * 4 / MB:.1f} MiB fp32); global batch {args.batch_size} x "
          f"{args.seq_len} tokens; {args.reps} reps x {args.steps} steps per implementation; torch {torch.__version__}")
    results, t0 = [], time.perf_counter()
    for world in args.ranks:
        skipped = [n for n in layouts if not LAYOUTS[n].applies(world)]
        if skipped:
            print(f"{world} ranks: skipping {skipped} (need 4 ranks)", file=sys.stderr)
        results += run_ranks(this.rank_main, world, cfg, layouts, args, timeout=args.timeout)[0]
    print(table(results))
    floors = {dp: floor(cfg, dp, args) for dp in sorted({r["dp"] for r in results})}
    print("\n" + floor_table(results, floors))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
