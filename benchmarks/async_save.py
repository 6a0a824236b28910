"""Training-step slowdown while an async save is in flight: a thread against a writer process.

    python benchmarks/async_save.py --reps 5

One process (a gloo group of one rank, so that torch DCP can take part) trains an MLP
(``--layers`` x ``--width``, AdamW, batch ``--batch``) with ``torch.set_num_threads(1)``: the
training loop's own work holds one core and the GIL most of the time, as a loop driving a GPU
does. The state saved is ``{"model", "optim", "step"}`` (model and AdamW moments, plus
``--ballast-mb`` of extra fp32 tensors of ``--ballast-tensor-kb`` each, so that a save spans many
steps). In rounds (one untimed
warm-up round that also starts the writer processes, then ``--reps`` timed rounds, the order
of the implementations rotating from round to round), each implementation runs right after a
phase of ``--steps`` training steps without a save (``none``), its reference: on a machine
shared with other jobs the load drifts over minutes, and the ratio to the phase just before
cancels most of that drift:

    none            ``--steps`` training steps, no save
    thread          shardwise.checkpoint.async_save(..., async_checkpointer_type="thread")
    process         shardwise.checkpoint.async_save(..., async_checkpointer_type="process")
    dcp-thread      torch.distributed.checkpoint.async_save(..., AsyncCheckpointerType.THREAD)
    dcp-process     torch.distributed.checkpoint.async_save(..., AsyncCheckpointerType.PROCESS)

starts a save and trains until the save's background write is done, then waits for it
(``result()``).

[Note: steps in flight]
Only the steps taken while the background write runs are timed in a save phase (each one
started before the write ended; the loop checks ``done()`` after every step), never steps
after it: padding the phase with steps after the write (as an earlier version did, up to
``--steps``) dilutes the slowdown by the share of quiet steps. So a save phase times as many
steps as fit in the write (the ``steps timed`` column); ``--ballast-mb`` sets how long that is.
Measured, per implementation (median over rounds):

    steps timed     the number of steps timed in the phase (``none``: ``--steps``)
    step            the median training-step time while the save was in flight (ms), and its
                    ratio to the ``none`` phase just before it (the slowdown; median over rounds,
                    with the smallest and largest)
    mean step       the same ratio for the mean step time (the loss of throughput, stalls
                    included), median over rounds
    rounds below    in how many rounds this implementation's step ratio was below the thread's
    call            the time ``async_save`` blocked the training loop (the copy to staging)
    in flight       from the call to the end of the background write
    peak RSS +      this process's peak RSS during the save minus its RSS before (VmHWM, reset
                    before each save; run with MALLOC_MMAP_THRESHOLD_=131072, set by re-executing
                    itself, so freed buffers go back to the OS): the snapshot, and staging
                    buffers touched for the first time
    writer process  the private memory (RssAnon, at the end of the save) of the writer process
                    the save used: shardwise's for ``process``, DCP's for ``dcp-process``; a
                    standing cost (mostly torch's import), paid once per rank
    staging kept    shardwise ``process``: the staging buffers kept for the next saves (shared
                    memory, counted in this process's RSS once touched)

Every checkpoint written is loaded back once per implementation (shardwise's with
shardwise.checkpoint.load, DCP's with torch.distributed.checkpoint.load) and compared with the
state of the moment the save started. ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._procstat import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

import shardwise.checkpoint as ck  # noqa: E402
from shardwise.checkpoint._save._process_writer import ProcessWriter  # noqa: E402

IMPLS = ("none", "thread", "process", "dcp-thread", "dcp-process")


def _children_anon_bytes(impl: str) -> int:
    """RssAnon of the writer process ``impl`` used: shardwise's for ``process``, the other
    children of this process (DCP's checkpoint process) for ``dcp-process``; 0 for threads."""
    if impl not in ("process", "dcp-process"):
        return 0
    ours = ProcessWriter._current.pid if ProcessWriter._current is not None else None
    total = 0
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() != me or "RssAnon" not in fields:
            continue
        if (int(pid) == ours) == (impl == "process"):
            total += int(fields["RssAnon"].split()[0]) * 1024
    return total


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per = args.ballast_tensor_kb * 256  # fp32 elements of one ballast tensor
    ballast = {f"b{i}": torch.randn(per) for i in range(args.ballast_mb * 1024 // args.ballast_tensor_kb)}
    return model, optim, ballast


def step(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def state_of(model: torch.nn.Module, optim: torch.optim.Optimizer, ballast: dict, n: int) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict(), "ballast": ballast, "step": n}


def copy_tensors(state: dict) -> dict:
    return {k: copy_tensors(v) if isinstance(v, dict) else (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}


def flat_tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def start(impl: str, state: dict, path: str):
    if impl in ("thread", "process"):
        return ck.async_save(state, path, async_checkpointer_type=impl)
    kind = AsyncCheckpointerType.THREAD if impl == "dcp-thread" else AsyncCheckpointerType.PROCESS
    handle = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind)
    return getattr(handle, "upload_completion", handle)  # a Future, or an AsyncSaveResponse


def check(impl: str, path: str, want: dict) -> None:
    target = {k: v if not isinstance(v, dict) else copy_tensors(v) for k, v in want.items()}
    for t in flat_tensors(target).values():
        t.zero_()
    if impl in ("thread", "process"):
        ck.load(target, path)
    else:
        dcp.load(target, checkpoint_id=path)
    got, exp = flat_tensors(target), flat_tensors(want)
    bad = [k for k in exp if not torch.equal(got[k], exp[k])]
    if bad:
        raise SystemExit(f"{impl}: the checkpoint at {path} differs from the saved state in {bad[:3]}")


def run_one(impl: str, model, optim, ballast, x, args, path: str, verify: bool) -> dict:
    times: list[float] = []
    if impl == "none":
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(model, optim, x)
            times.append(time.perf_counter() - t0)
        return {"step": statistics.median(times), "mean": statistics.fmean(times), "steps": len(times)}
    state = state_of(model, optim, ballast, 1)
    want = copy_tensors(state) if verify else None
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    handle = start(impl, state, path)
    call = time.perf_counter() - t0
    flight = call if handle.done() else None
    children = 0
    while flight is None:  # only steps that overlap the background write: [Note: steps in flight]
        t1 = time.perf_counter()
        step(model, optim, x)
        times.append(time.perf_counter() - t1)
        if not children:
            children = _children_anon_bytes(impl)  # the writer process's memory while it writes
        if handle.done():
            flight = time.perf_counter() - t0
    if not times:  # the write ended within the call: one step after it, so the row is not empty
        t1 = time.perf_counter()
        step(model, optim, x)
        times.append(time.perf_counter() - t1)
        children = _children_anon_bytes(impl)
    handle.result()
    peak = peak_rss_bytes() - before
    staging = 0
    if impl == "process" and ProcessWriter._current is not None:
        staging = sum(buf.numel() for buf, _, _ in ProcessWriter._current._slots.values())
    if want is not None:
        check(impl, path, want)
    shutil.rmtree(path, ignore_errors=True)
    return {"step": statistics.median(times), "mean": statistics.fmean(times), "steps": len(times), "call": call,
            "flight": flight,
            "peak_bytes": peak, "writer_anon_bytes": children, "staging_bytes": staging}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ballast-mb", type=int, default=256)
    p.add_argument("--ballast-tensor-kb", type=int, default=1024,
                   help="size of each ballast tensor: small ones make the writer's per-tensor Python work (which "
                        "holds the GIL) large against its copying and checksumming (which release it)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--dir", default=None, help="where checkpoints go (a real disk); default: a temporary folder")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # freed buffers go back to the OS: peaks comparable
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="async-save-bench-", dir=args.dir)
    model, optim, ballast = build(args)
    x = torch.randn(args.batch, args.width)
    for _ in range(3):
        step(model, optim, x)
    state_bytes = sum(t.numel() * t.element_size() for t in flat_tensors(state_of(model, optim, ballast, 0)).values())
    rounds: list[dict[str, dict]] = []
    try:
        saving = [i for i in impls if i != "none"]
        for r in range(args.reps + 1):
            order = saving[r % len(saving):] + saving[:r % len(saving)]
            out: dict[str, dict] = {}
            nones = []
            for impl in order:  # each save bracketed by a phase without one just before it
                nones.append(run_one("none", model, optim, ballast, x, args, "", False))
                out[impl] = run_one(impl, model, optim, ballast, x, args, os.path.join(root, f"{impl}-{r}"), r == 0)
                out[impl]["ratio"] = out[impl]["step"] / nones[-1]["step"]
                out[impl]["mean_ratio"] = out[impl]["mean"] / nones[-1]["mean"]
            out["none"] = {"step": statistics.median(n["step"] for n in nones), "ratio": 1.0, "mean_ratio": 1.0,
                           "steps": statistics.median(n["steps"] for n in nones)}
            if r > 0:
                rounds.append(out)
                print(f"round {r}: " + ", ".join(
                    f"{i} {out[i]['step'] * 1e3:.1f} ms (x{out[i]['ratio']:.2f}, mean x{out[i]['mean_ratio']:.2f}, "
                    f"{out[i]['steps']:.0f} steps)" for i in ["none", *saving]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = {}
    for impl in ["none", *saving]:
        rows = [rd[impl] for rd in rounds]
        row = {"step_ms": statistics.median(x["step"] for x in rows) * 1e3,
               "slowdown": statistics.median(x["ratio"] for x in rows),
               "slowdown_min": min(x["ratio"] for x in rows), "slowdown_max": max(x["ratio"] for x in rows),
               "mean_slowdown": statistics.median(x["mean_ratio"] for x in rows),
               "steps": statistics.median(x["steps"] for x in rows),
               "wins": None if impl in ("none", "thread") or "thread" not in saving
               else sum(rd[impl]["ratio"] < rd["thread"]["ratio"] for rd in rounds)}
        if impl != "none":
            row.update(call_s=statistics.median(x["call"] for x in rows),
                       flight_s=statistics.median(x["flight"] for x in rows),
                       peak_mib=statistics.median(x["peak_bytes"] for x in rows) / 2**20,
                       writer_anon_mib=statistics.median(x["writer_anon_bytes"] for x in rows) / 2**20,
                       staging_mib=statistics.median(x["staging_bytes"] for x in rows) / 2**20)
        table[impl] = row
    print(f"\nstate {state_bytes / 2**20:.0f} MiB; {args.layers} x {args.width} MLP, batch {args.batch}; "
          f"medians of {args.reps} rounds\n")
    print("| impl | steps timed | step (ms) | step / none (min-max) | mean step / none | rounds below thread "
          "| async_save call (s) | in flight (s) | peak RSS + (MiB) | writer process (MiB) | staging kept (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for impl, row in table.items():
        cells = [f"{row['steps']:.0f}", f"{row['step_ms']:.1f}",
                 f"{row['slowdown']:.2f} ({row['slowdown_min']:.2f}-{row['slowdown_max']:.2f})",
                 f"{row['mean_slowdown']:.2f}", "" if row["wins"] is None else f"{row['wins']}/{len(rounds)}"]
        if impl != "none":
            cells += [f"{row['call_s']:.2f}", f"{row['flight_s']:.2f}", f"{row['peak_mib']:.0f}",
                      f"{row['writer_anon_mib']:.0f}", f"{row['staging_mib']:.0f}"]
        else:
            cells += [""] * 5
        print(f"| {impl} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "state_bytes": state_bytes, "table": table, "rounds": rounds}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
