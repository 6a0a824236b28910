"""Checkpoint save and resharded load: shardwise.checkpoint against torch.distributed.checkpoint.

    python benchmarks/checkpoint.py        # save on 4 gloo ranks, then load on 2 and on 3 ranks

One command runs everything: this launcher starts ``torchrun --standalone`` three times, for the
save world (``--save-world``, 4) and for each load world (``--load-worlds``, 2 and 3), in a
temporary directory (``--dir``, which must be on a real disk, not tmpfs) that it deletes at the
end. Every rank builds the Llama of ``examples/model.py`` from one seed, shards it with
shardwise's ``fully_shard`` (one unit per block, then the root: every tensor ``Shard(0)``
over all ranks) and trains one AdamW step. The state is
``{"model": get_model_state_dict, "optim": get_optimizer_state_dict, "trainer": {"step"}}``:
the same DTensor state dict is handed to every implementation, so they all save and load
exactly the same shards and only the checkpoint code differs:

    shardwise   shardwise.checkpoint.save / load(verify=False); also load with the default
                verify=True (CRC-32 of every checksum chunk of the saved boxes it loads from,
                each chunk checked by the one rank that loads most of it)
    dcp         torch.distributed.checkpoint.save / load with the default FileSystemWriter /
                FileSystemReader and default planners
    dcp-hf      DCP with HuggingFaceStorageWriter(save_distributed=True) / HuggingFaceStorageReader;
                tensors only (the HF format holds no plain values: param_groups, trainer step)

Save (on ``--save-world`` ranks) and load (into the layout of each load world: ``Shard(0)`` over
2 ranks, which meets the saved 4-rank boundaries, and over 3, which does not) run in rounds:
one untimed warm-up round, then ``--reps`` timed rounds, each running every implementation once,
in an order that rotates from round to round. Before every operation all ranks meet, rank 0
writes back dirty pages and drops the page cache (root only; ``--no-drop`` keeps it), and each
rank resets its peak RSS. Ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed buffers
go back to the OS and one run's RSS does not depend on the runs before it. Measured per
operation:

    time        rank 0's wall time from a barrier before to a barrier after the operation; also
                its ratio to the DCP run of the same round (median over rounds)
    peak RSS    per rank, VmHWM after minus VmRSS before (VmHWM reset with /proc/self/clear_refs)
    read        per rank, /proc/self/io read_bytes: bytes fetched from the disk, cold page cache;
                each load rank reads its own copy of the checkpoint, so no rank is served pages
                another rank brought in. Without root (or with --no-drop): rchar, the bytes
                returned by read calls, cached or not (it misses reads through mmap)
    needed      per rank, the bytes of its target shards (what a load cannot do without)

A last table (``--boxes N``, default 100000; 0 skips it; ``--boxes-only`` runs only it) times the
checks of one ``[1, N]`` float32 tensor saved as N boxes of one element (the index and header
such a save writes), in this process: ``inspect``, ``verify`` and ``load`` (verify=True) into a
plain tensor. The tiling check was quadratic there (73 s for inspect at N = 4000).

After every load each rank checks that every tensor holds what was saved (sum and sum of
absolute values per tensor, over all ranks, against the values taken at save time). Rank 0 of
the launcher prints a Markdown table (and ``--json`` writes every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples`, `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import _procstat as proc  # noqa: E402

MB = 2**20
SAVE_IMPLS = ("shardwise", "dcp", "dcp-hf")
# load implementation -> the checkpoint it reads (the one that implementation saved)
LOAD_SOURCE = {"shardwise": "shardwise", "shardwise-verify": "shardwise", "dcp": "dcp", "dcp-hf": "dcp-hf"}
SHOWN = {"shardwise": "shardwise", "dcp": "DCP", "dcp-hf": "DCP, HF safetensors writer"}
SHOWN_LOAD = {"shardwise": "shardwise, verify=False", "shardwise-verify": "shardwise, verify=True (default)",
              "dcp": "DCP", "dcp-hf": "DCP, HF safetensors reader"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--save-world", type=int, default=4)
    p.add_argument("--load-worlds", default="2,3", help="comma list of world sizes to load into")
    p.add_argument("--reps", type=int, default=7, help="timed rounds (after one untimed warm-up round)")
    p.add_argument("--impls", default="shardwise,dcp,dcp-hf", help="comma list of shardwise, dcp, dcp-hf")
    p.add_argument("--dir", default=None, help="where the temporary directory goes (default: the system's)")
    p.add_argument("--no-drop", action="store_true", help="keep the page cache (warm reads; what non-root runs get)")
    p.add_argument("--json", default=None, help="also write every figure here")
    p.add_argument("--boxes", type=int, default=100_000, help="boxes of the many-boxes row (0: skip it)")
    p.add_argument("--boxes-only", action="store_true", help="run only the many-boxes row")
    p.add_argument("--phase", choices=("save", "load"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# worker side (one process per rank, under torchrun)
# ---------------------------------------------------------------------------------------------

def _tensors(tree, prefix=""):
    """``(flat key, tensor)`` for every tensor of a dict/list tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            yield key, v
        elif isinstance(v, (dict, list, tuple)):
            yield from _tensors(v, key + "/")


def _tensors_only(tree):
    """The dict tree with only its tensors (what the HF safetensors writer can hold)."""
    if isinstance(tree, dict):
        out = {k: _tensors_only(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) or (isinstance(v, dict) and v)}
    return tree if isinstance(tree, torch.Tensor) else None


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fingerprint(state, rank: int) -> dict[str, list[float]]:
    """Per tensor: sum and sum of |x| over the whole tensor (each element counted once: DTensor
    shards are disjoint here, every tensor being Shard(0) on a 1-D mesh; plain tensors by rank 0)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    items = list(_tensors(state))
    sums = torch.zeros(len(items), 2, dtype=torch.float64)
    with torch.no_grad():
        for i, (_, t) in enumerate(items):
            if isinstance(t, DTensor) or rank == 0:
                x = _local(t).double()
                sums[i, 0], sums[i, 1] = x.sum(), x.abs().sum()
    dist.all_reduce(sums)
    return {k: sums[i].tolist() for i, (k, _) in enumerate(items)}


def _mismatches(got: dict, want: dict) -> list[str]:
    bad = []
    for k, (s, a) in got.items():
        ws, wa = want[k]
        if abs(a - wa) > 1e-9 * max(wa, 1.0) or abs(s - ws) > 1e-9 * max(wa, 1.0):
            bad.append(f"{k}: sum {s} / {ws}, sum|x| {a} / {wa}")
    return bad


def _build(args, world: int):
    """Model sharded over all ``world`` ranks, AdamW state from one training step, and the state."""
    from examples.model import LlamaConfig
    from examples.train import app_state, build_and_shard, train
    from shardwise.mesh import data_parallel_mesh, init_mesh

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    dp_mesh = data_parallel_mesh(init_mesh(dp_replicate=1, dp_shard=-1))
    model = build_and_shard(cfg, dp_mesh, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, dp_mesh, steps=1, batch_size=world * 2, seq_len=32, vocab=args.vocab, optim=optim)
    return model, optim, app_state(model, optim, 1), cfg


def _save(impl: str, state, path: str) -> None:
    if impl == "shardwise":
        import shardwise.checkpoint as ckpt

        ckpt.save(state, path)
    elif impl == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    elif impl == "dcp-hf":
        import torch.distributed.checkpoint as dcp

        dcp.save(_tensors_only(state), storage_writer=dcp.HuggingFaceStorageWriter(path, save_distributed=True))
    else:
        raise ValueError(impl)


def _load(impl: str, state, path: str) -> None:
    if impl in ("shardwise", "shardwise-verify"):
        import shardwise.checkpoint as ckpt

        ckpt.load(state, path, verify=impl == "shardwise-verify")
    elif impl == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    elif impl == "dcp-hf":
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
    else:
        raise ValueError(impl)


def _measured(fn, cold: bool) -> dict:
    """Run the collective ``fn`` on every rank between barriers, cold page cache first."""
    import torch.distributed as dist

    dist.barrier()
    if cold and dist.get_rank() == 0:
        proc.drop_page_cache()
    dist.barrier()
    proc.reset_peak_rss()
    rss0, io0 = proc.rss_bytes(), proc.io_counters()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    seconds = time.perf_counter() - t0
    io1 = proc.io_counters()
    return dict(seconds=seconds, peak_rss_delta=proc.peak_rss_bytes() - rss0,
                read_bytes=io1["read_bytes"] - io0["read_bytes"], rchar=io1["rchar"] - io0["rchar"],
                write_bytes=io1["write_bytes"] - io0["write_bytes"])


def _rounds(impls: list[str], reps: int):
    """(round, impl) pairs: round 0 is the warm-up; the order rotates every round."""
    for r in range(reps + 1):
        k = r % len(impls)
        for impl in impls[k:] + impls[:k]:
            yield r, impl


def _local_sizes(state) -> dict:
    sizes = [_local(t).numel() * _local(t).element_size() for _, t in _tensors(state)]
    full = [t.numel() * t.element_size() for _, t in _tensors(state)]
    return dict(bytes=sum(sizes), largest_local=max(sizes), largest_full=max(full), tensors=len(sizes))


def worker(args) -> None:
    import torch.distributed as dist
    from shardwise.mesh import init_distributed

    t_start = time.perf_counter()
    torch.set_num_threads(1)
    rank, world = init_distributed()
    cold = proc.can_drop_page_cache() and not args.no_drop
    root = Path(args.root)
    impls = args.impls.split(",")
    model, optim, state, cfg = _build(args, world)
    t_built = time.perf_counter()
    runs = []
    if args.phase == "save":
        fingerprint = _fingerprint(state, rank)
        out = root / "save"
        for rnd, impl in _rounds(impls, args.reps):
            path = str(out / f"{impl}-{rnd}")
            m = _measured(lambda: _save(impl, state, path), cold)
            dist.barrier()
            if rank == 0 and rnd < args.reps:  # keep the last round's checkpoint for the loads
                shutil.rmtree(path)
            runs.append(dict(round=rnd, impl=impl, **m))
        extra = dict(fingerprint=fingerprint)
    else:
        fingerprint = json.loads((root / "save.json").read_text())["fingerprint"]
        impls = [i for i in LOAD_SOURCE if LOAD_SOURCE[i] in impls]
        targets = {i: _tensors_only(state) if i == "dcp-hf" else state for i in impls}
        for rnd, impl in _rounds(impls, args.reps):
            copy = root / "save" if rank == 0 else root / f"copy-{rank}"
            path = str(copy / f"{LOAD_SOURCE[impl]}-{args.reps}")
            target = targets[impl]
            with torch.no_grad():
                for _, t in _tensors(target):
                    _local(t).zero_()
            m = _measured(lambda: _load(impl, target, path), cold)
            got = _fingerprint(target, rank)
            bad = _mismatches(got, fingerprint)
            if bad:
                raise RuntimeError(f"{impl} loaded wrong values on {world} ranks: " + "; ".join(bad[:5]))
            runs.append(dict(round=rnd, impl=impl, **m))
        extra = dict(needed={i: _local_sizes(targets[i])["bytes"] for i in impls})
    if rank == 0:
        print(f"[{args.phase} on {world} ranks: set-up {t_built - t_start:.0f} s (since the imports), "
              f"{args.reps + 1} rounds {time.perf_counter() - t_built:.0f} s]", flush=True)
    mine = dict(rank=rank, runs=runs, sizes=_local_sizes(state), **extra)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        numel = sum(p.numel() for p in model.parameters())
        result = dict(phase=args.phase, world=world, cold=cold, cfg=str(cfg), params=numel, ranks=ranks)
        if args.phase == "save":
            result["fingerprint"] = fingerprint
        name = "save.json" if args.phase == "save" else f"load-{world}.json"
        (root / name).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# launcher side
# ---------------------------------------------------------------------------------------------

def _torchrun(nproc: int, argv: list[str], root: Path, phase: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               # big buffers always mmapped and returned to the OS when freed: RSS deltas of
               # successive runs in one process do not depend on what an earlier run left in the heap
               MALLOC_MMAP_THRESHOLD_="131072")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), *argv, "--phase", phase, "--root", str(root)]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    print(f"[{phase} on {nproc} ranks: {time.perf_counter() - t0:.0f} s]", flush=True)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _summary(res: dict, impls: list[str], phase: str) -> list[dict]:
    rows = []
    for impl in impls:
        timed = [[run for run in r["runs"] if run["impl"] == impl and run["round"] > 0] for r in res["ranks"]]
        if not timed[0]:
            continue
        row = dict(impl=impl, phase=phase, world=res["world"],
                   seconds=[run["seconds"] for run in timed[0]],
                   median_s=statistics.median(run["seconds"] for run in timed[0]),
                   peak_rss_delta=[max(run["peak_rss_delta"] for run in rk) for rk in timed],
                   read_bytes=[statistics.median(run["read_bytes"] for run in rk) for rk in timed],
                   rchar=[statistics.median(run["rchar"] for run in rk) for rk in timed],
                   largest_local=[r["sizes"]["largest_local"] for r in res["ranks"]],
                   largest_full=res["ranks"][0]["sizes"]["largest_full"])
        if phase == "load":
            row["needed"] = [r["needed"][impl] for r in res["ranks"]]
        rows.append(row)
    base = next((r["seconds"] for r in rows if r["impl"] == "dcp"), None)
    for row in rows:  # per round against the DCP run of the same round, then the median
        row["ratio_to_dcp"] = statistics.median(a / b for a, b in zip(row["seconds"], base)) if base else None
    return rows


def _mib(xs) -> str:
    return " / ".join(f"{x / MB:.1f}" for x in xs)


def report(save: dict, sizes: dict, rows: list[dict]) -> str:
    r0 = save["ranks"][0]["sizes"]
    lines = [f"model: {save['cfg']}; {save['params']:,} fp32 params = {save['params'] * 4 / MB:.1f} MiB; "
             f"state (params + AdamW exp_avg, exp_avg_sq, step) {r0['tensors']} tensors, "
             f"{sum(r['sizes']['bytes'] for r in save['ranks']) / MB:.1f} MiB over {save['world']} ranks; "
             f"largest tensor {r0['largest_full'] / MB:.1f} MiB full, {r0['largest_local'] / MB:.1f} MiB per "
             f"save rank", "checkpoint size on disk: " + ", ".join(f"{k} {v / MB:.1f} MiB" for k, v in sizes.items()),
             f"page cache dropped before every operation: {save['cold']} "
             f"(read = /proc/self/io {'read_bytes: bytes fetched from the disk' if save['cold'] else 'rchar: bytes returned by read calls, cached or not; mmap reads (the HF reader) are missed'})",
             "",
             "| operation | implementation | median s | / DCP | s per round | peak RSS delta MiB per rank | "
             "read MiB per rank | needed MiB per rank | read / needed |",
             "| --- | --- | ---: | ---: | --- | --- | --- | --- | ---: |"]
    read = "read_bytes" if save["cold"] else "rchar"
    for row in rows:
        op = f"save, {row['world']} ranks" if row["phase"] == "save" else f"load into {row['world']} ranks"
        secs = " ".join(f"{s:.2f}" for s in row["seconds"])
        if row["phase"] == "load":
            ratio = max(r / n for r, n in zip(row[read], row["needed"]))
            tail = f"{_mib(row[read])} | {_mib(row['needed'])} | {ratio:.2f}"
        else:
            tail = "| |"
        name = (SHOWN if row["phase"] == "save" else SHOWN_LOAD)[row["impl"]]
        ratio_dcp = "" if row["ratio_to_dcp"] is None else f"{row['ratio_to_dcp']:.2f}"
        lines.append(f"| {op} | {name} | {row['median_s']:.2f} | {ratio_dcp} | {secs} | {_mib(row['peak_rss_delta'])} | "
                     f"{tail} |")
    return "\n".join(lines)


def many_boxes_checkpoint(path: str, n: int) -> None:
    """A checkpoint of one ``[1, n]`` float32 tensor saved as n boxes of one element each."""
    from shardwise.checkpoint._format import (Index, SavedBox, StreamingWriter, TensorEntry, format_index,
                                              index_to_json)
    from shardwise.checkpoint._geometry import Box

    os.makedirs(path)
    data = os.path.join(path, "rank-00000.safetensors")
    writer = StreamingWriter(data, [(f"w@0,{i}", torch.float32, (1, 1)) for i in range(n)])
    values = torch.arange(float(n))
    for k in writer.keys:
        writer.append(values[int(k.split(",")[1])].reshape(1, 1))
    sums = writer.close()
    boxes = tuple(SavedBox(Box((0, i), (1, 1)), "rank-00000.safetensors", f"w@0,{i}", sums[f"w@0,{i}"].crc32)
                  for i in range(n))
    index = Index({"w": TensorEntry(torch.float32, (1, n), boxes)}, {}, {"rank-00000.safetensors":
                  os.path.getsize(data)}, 1, time.time_ns())
    Path(path, "index.json").write_text(format_index(index_to_json(index)))


def boxes_report(n: int, where: str | None) -> str:
    """The many-boxes table: seconds of inspect, verify and load of `many_boxes_checkpoint`."""
    import contextlib
    import io

    from shardwise.checkpoint import load, main as cli, verify_checkpoint

    root = tempfile.mkdtemp(prefix="shardwise-boxes-", dir=where)
    try:
        path = os.path.join(root, "ck")
        t = time.perf_counter()
        many_boxes_checkpoint(path, n)
        built = time.perf_counter() - t
        times = {}
        with contextlib.redirect_stdout(io.StringIO()):
            t = time.perf_counter()
            assert cli(["inspect", path]) == 0
            times["inspect"] = time.perf_counter() - t
        t = time.perf_counter()
        assert verify_checkpoint(path).fully_checked
        times["verify"] = time.perf_counter() - t
        target = {"w": torch.zeros(1, n)}
        t = time.perf_counter()
        load(target, path)
        times["load"] = time.perf_counter() - t
        assert torch.equal(target["w"][0], torch.arange(float(n)))
        index_mb = os.path.getsize(os.path.join(path, "index.json")) / 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ("\n".join(["", f"one [1, {n}] float32 tensor saved as {n} boxes (index {index_mb:.1f} MB, built in "
                        f"{built:.1f} s):", "", "| operation | seconds |", "| --- | --- |"]
                       + [f"| {k} | {v:.2f} |" for k, v in times.items()]))


def launcher(args, argv: list[str]) -> None:
    if args.boxes_only:
        print(boxes_report(args.boxes, args.dir))
        return
    impls = args.impls.split(",")
    unknown = set(impls) - set(SAVE_IMPLS)
    if unknown:
        raise SystemExit(f"unknown --impls {sorted(unknown)}; use {', '.join(SAVE_IMPLS)}")
    if "dcp-hf" in impls:
        import torch.distributed.checkpoint as dcp

        if not hasattr(dcp, "HuggingFaceStorageWriter"):
            print("torch.distributed.checkpoint has no HuggingFaceStorageWriter in this torch: skipping dcp-hf")
            impls.remove("dcp-hf")
            argv = [*argv, "--impls", ",".join(impls)]
    if not proc.can_drop_page_cache() and not args.no_drop:
        print("not root: cannot drop the page cache; reads are warm and 'read' is rchar, not read_bytes")
    worlds = [int(w) for w in args.load_worlds.split(",") if w]
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="shardwise-ckpt-bench-", dir=args.dir))
    try:
        _torchrun(args.save_world, argv, root, "save")
        save = json.loads((root / "save.json").read_text())
        sizes = {i: _dir_bytes(root / "save" / f"{i}-{args.reps}") for i in impls}
        for r in range(1, max(worlds, default=1)):  # each load rank reads its own copy
            for i in impls:
                shutil.copytree(root / "save" / f"{i}-{args.reps}", root / f"copy-{r}" / f"{i}-{args.reps}")
        loads = []
        for w in worlds:
            _torchrun(w, argv, root, "load")
            loads.append(json.loads((root / f"load-{w}.json").read_text()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = _summary(save, impls, "save")
    for res in loads:
        rows += _summary(res, [i for i in LOAD_SOURCE if LOAD_SOURCE[i] in impls], "load")
    print(report(save, sizes, rows))
    if args.boxes:
        print(boxes_report(args.boxes, args.dir))
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(argv=sys.argv, sizes=sizes, rows=rows, save=save, loads=loads),
                                              indent=1))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.phase is None:
        if "RANK" in os.environ:
            raise SystemExit("run this launcher with plain python (it starts torchrun itself): "
                             "python benchmarks/checkpoint.py")
        launcher(args, argv)
    else:
        worker(args)


if __name__ == "__main__":
    main()
