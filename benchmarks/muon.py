"""Muon's (and AdamW's) ``optimizer.step()`` on a sharded model: shardwise's whole-matrix owners
against one process, torch's FSDP2 + ``torch.optim.Muon``, and the ideal.

    python benchmarks/muon.py --ranks 1 2 4 --reps 9        # gloo ranks on CPU, one thread each

The model is the issue's: ``--layers`` x ``Linear(--dim, --dim, bias=False)``, each layer a
``fully_shard`` unit and the root too, fp32. Every implementation gets the same fixed random
gradients once and then only ``step()`` is timed (the step does not clear gradients), so the
figures are the optimizer's alone. Per world size ``W``, in one launch of ``W`` gloo ranks:

    one process        torch.optim.Muon on the unsharded model, timed on rank 0 while the other
                       ranks wait at a barrier (W = 1: the same, alone)
    torch FSDP2        torch's fully_shard + torch.optim.Muon over the DTensor parameters (each
                       Newton-Schulz matmul redistributes through DTensor)
    shardwise plain    shardwise's fully_shard + torch.optim.Muon over the DTensors (the same path)
    shardwise owners   shardwise's fully_shard + WholeMatrixOptimizer(torch.optim.Muon): each
                       matrix gathered to one owner, updated whole, its rows sent back
    ideal              one process's step / W + the time of the owners' two all-to-alls alone
                       (the same splits, replayed without compute, in the same ranks)

and for AdamW the one process, torch FSDP2 and shardwise (elementwise: no owners, no bytes).
The implementations alternate within each of ``--reps`` repetitions so all see the same load.
Reported per implementation: the median over repetitions of rank 0's wall time of one step and
of the *CPU time* of one step (the process's, all threads: compute and gloo), the largest over
the ranks: the machine this runs on is shared, and CPU time is what sharding divides. Bytes: what
one rank sends per step by `benchmarks._comm_count.CommCounter` (ring convention; an all-to-all
counts ``(n - 1) / n`` of its input; "n/c": not counted, the collectives DTensor issues inside
Muon's matmuls do not reach the counter), and the owners' theory ``3 P (W - 1) / W^2`` for ``P`` bytes
of matrices (a rank sends its rows of every parameter and gradient to their owners, and each owner
the rows of its ``P / W`` back).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks`, `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from benchmarks._comm_count import CommCounter  # noqa: E402

MB = 2**20


def _model(args) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)))


def _set_grads(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g) * 1e-2
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


def _shard(model: nn.Sequential, fully_shard, mesh) -> nn.Sequential:
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _timed(fn) -> tuple[float, float]:
    """(rank 0's wall seconds, the largest CPU seconds over the ranks) of ``fn()``."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    wall = time.perf_counter() - t0
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return wall, cpu.item()


def _a2a_replay(splits: list[tuple[list[int], list[int], object]]):
    """The owners' all-to-alls with their recorded splits, alone (no packing, no compute)."""
    bufs = [(torch.empty(sum(o), dtype=torch.uint8), torch.zeros(sum(i), dtype=torch.uint8), o, i, g)
            for o, i, g in splits]

    def run():
        for out, inp, o, i, g in bufs:
            dist.all_to_all_single(out, inp, o, i, group=g)
    return run


def rank_main(rank: int, world: int, args) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    from shardwise.composable import WholeMatrixOptimizer, fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    base = _model(args)
    impls: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for opt_name, make in (("muon", lambda ps: torch.optim.Muon(ps, lr=0.02)),
                           ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3))):
        one = copy.deepcopy(base)
        impls[f"{opt_name}/one process"] = (one, make(one.parameters()))
        tm = _shard(copy.deepcopy(base), torch_fsdp.fully_shard, mesh)
        impls[f"{opt_name}/torch FSDP2"] = (tm, make(tm.parameters()))
        sm = _shard(copy.deepcopy(base), fully_shard, mesh)
        impls[f"{opt_name}/shardwise" + (" plain" if opt_name == "muon" else "")] = (sm, make(sm.parameters()))
    om = _shard(copy.deepcopy(base), fully_shard, mesh)
    impls["muon/shardwise owners"] = (om, WholeMatrixOptimizer(torch.optim.Muon, om.parameters(), lr=0.02,
                                                               buckets=args.buckets))
    for model, _ in impls.values():
        _set_grads(model)

    # bytes and the owners' splits, from one step of each (also the warm-up)
    comm: dict[str, float] = {}
    splits: list = []
    real = dist.all_to_all_single

    def spy(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        splits.append((list(output_split_sizes), list(input_split_sizes), group))
        return real(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    for name, (model, opt) in impls.items():
        if name.endswith("one process"):
            if rank == 0:
                opt.step()
            comm[name] = 0.0
            continue
        counter = CommCounter()
        if name == "muon/shardwise owners":
            dist.all_to_all_single = spy
        try:
            with counter:
                opt.step()
        finally:
            dist.all_to_all_single = real
        comm[name] = counter.sent_bytes
    replay = _a2a_replay(splits)
    replay()

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in impls}
    times["muon/owners' all-to-alls alone"] = []
    for _ in range(args.reps):
        for name, (model, opt) in impls.items():
            if name.endswith("one process"):
                times[name].append(_timed(opt.step if rank == 0 else (lambda: None)))
            else:
                times[name].append(_timed(opt.step))
        times["muon/owners' all-to-alls alone"].append(_timed(replay))
    matrix_bytes = sum(p.numel() * 4 for p in base.parameters())
    return {"world": world, "times": times, "comm": comm, "matrix_bytes": matrix_bytes}


def table(results: list[dict]) -> str:
    med = statistics.median
    rows = ["| ranks | optimizer | implementation | step ms (wall, rank 0) | step ms (CPU, max over ranks) | "
            "CPU / one process | CPU / ideal | sent MiB/rank/step |",
            "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        w = r["world"]
        t = {k: (med(a for a, _ in v), med(c for _, c in v)) for k, v in r["times"].items()}
        a2a = t.pop("muon/owners' all-to-alls alone")
        one = {o: t[f"{o}/one process"] for o in ("muon", "adamw")}
        ideal = (one["muon"][0] / w + a2a[0], one["muon"][1] / w + a2a[1])
        theory = 3 * r["matrix_bytes"] * (w - 1) / w ** 2
        for name, (wall, cpu) in t.items():
            o, impl = name.split("/")
            vs_ideal = f"{cpu / ideal[1]:.2f}" if o == "muon" else ""
            sent = r["comm"][name]
            shown = f"{sent / MB:.2f}" if sent or impl in ("one process", "shardwise") else "n/c"
            rows.append(f"| {w} | {o} | {impl} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {cpu / one[o][1]:.2f} | "
                        f"{vs_ideal} | {shown} |")
        rows.append(f"| {w} | muon | ideal: one process / {w} + the all-to-alls alone ({a2a[1] * 1e3:.1f} ms CPU) | "
                    f"{ideal[0] * 1e3:.1f} | {ideal[1] * 1e3:.1f} | {ideal[1] / one['muon'][1]:.2f} | 1.00 | "
                    f"{theory / MB:.2f} (theory) |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes, one launch each")
    p.add_argument("--reps", type=int, default=9, help="interleaved repetitions per implementation")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--buckets", type=int, default=4, help="WholeMatrixOptimizer(buckets=)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from benchmarks import muon as this  # the ranks import the rank function by module name
    from tests._dist import run_ranks

    args = parse_args(argv)
    print(f"{args.layers} x Linear({args.dim}, {args.dim}, bias=False), fp32, fully_shard per layer; gloo, one thread "
          f"per rank; {args.reps} reps; torch {torch.__version__}")
    t0 = time.perf_counter()
    results = [run_ranks(this.rank_main, w, args, timeout=args.timeout)[0] for w in args.ranks]
    print(table(results))
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
