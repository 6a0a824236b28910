"""Context parallelism on 4 ranks, side by side in one run: cp = 1, 2, 4 and the two attention
methods (ring, all-gather), against torch's experimental ``context_parallel`` where it runs.

    torchrun --nproc-per-node 4 benchmarks/context_parallel.py            # 4 gloo ranks on CPU

Three measurements, each with the Llama of ``examples/model.py`` wired as ``examples/cp.py``
does (``fully_shard`` over ``dp_shard x cp``, attention routed to the ring):

* **activation memory per rank** for one sample per data-parallel group (global batch
  ``4 / cp``): the peak tensor bytes of one forward + backward (`benchmarks.tracker`), minus
  what was live before it (parameters, optimizer state); the cp = 1 rank holds the whole
  sequence, a cp = 4 rank a quarter of it. Target: about ``1 / cp``.
* **step time** at the same global tokens (global batch 4 for every cp: per rank, cp = 1 holds
  one whole sequence, cp = 4 a quarter of four): median of ``--steps`` timed steps after one
  warm-up, ratio against cp = 1 (what the ring's messages cost when there is no memory to save).
* **bytes moved by one attention layer** (forward + backward, one rank, ``CommCounter`` plus
  the ring's ``isend`` calls), against the theory with ``K`` the bytes of one rank's keys and
  values and ``G`` their float32 gradients::

      ring       forward (cp - 1) K       backward (cp - 1) K + cp G
      allgather  forward (cp - 1) K       backward (cp - 1) K + (cp - 1) G   (ring-algorithm bytes)

* **CP x PP** (``--pp-rows``, default on): ``pp 2 x cp 2`` against ``pp 2 x dp_shard 2`` (both
  1F1B, 2 microbatches, the stages wired as ``examples/pipeline_setup.py`` does): step time at
  global batch 4, and the activation memory of a step with one sample per microbatch of each
  data-parallel group (the largest over the ranks: stage 0 holds more microbatches).

Rank 0 prints a table and, with ``--json``, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._comm_count import CommCounter  # noqa: E402
from benchmarks.tracker import AllocationTracker  # noqa: E402
from examples.cp import apply_cp, cp_shard  # noqa: E402
from examples.data import global_batch, local_slice  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402
from examples.parallel import apply_fsdp  # noqa: E402
import shardwise.composable as sw  # noqa: E402
from shardwise.mesh import cp_mesh, data_parallel_mesh, init_distributed, init_mesh  # noqa: E402

MB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--json", default=None)
    p.add_argument("--no-pp-rows", dest="pp_rows", action="store_false", help="skip the CP x PP rows")
    return p.parse_args(argv)


class _P2PCounter(CommCounter):
    """`CommCounter` plus the bytes of every point-to-point send (the ring's ``isend``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p2p = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.send"):
            self.p2p += sum(t.numel() * t.element_size() for t in args[0])
        return super().__torch_dispatch__(func, types, args, kwargs)


def _model(args, mesh, method):
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq_len)
    model = apply_fsdp(Llama(cfg, generator=torch.Generator().manual_seed(0)), data_parallel_mesh(mesh))
    cpm = cp_mesh(mesh)
    if cpm is not None:
        apply_cp(model, cpm, method)
    return model


def _batch(args, mesh, step, global_batch_size):
    from examples.train import data_parallel_rank

    dp_rank, dp_size = data_parallel_rank(mesh)
    cpm = cp_mesh(mesh)
    cp_rank, cp = (cpm.get_local_rank(), cpm.size()) if cpm is not None else (0, 1)
    tokens = local_slice(global_batch(step, global_batch_size, args.seq_len, args.vocab, 0), dp_rank, dp_size)
    return cp_shard(tokens, cp_rank, cp)


def _step(model, optim, inputs, targets, pos):
    loss = F.cross_entropy(model(inputs, pos).flatten(0, 1), targets.flatten())
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def _measure(args, cp, method) -> dict:
    mesh = init_mesh(cp=cp, device_type="cpu")
    model = _model(args, mesh, method)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optim, *_batch(args, mesh, 0, 4))  # warm-up: lazy init, optimizer state
    times = []
    for s in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, optim, *_batch(args, mesh, s + 1, 4))
        times.append(time.perf_counter() - t0)
    # activation memory: one sample per data-parallel group
    inputs, targets, pos = _batch(args, mesh, 99, 4 // cp)
    tracker = AllocationTracker()
    tracker.track(list(model.parameters()), "params")
    tracker.track([t for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)], "optim")
    base = tracker.current()
    with tracker:
        loss = F.cross_entropy(model(inputs, pos).flatten(0, 1), targets.flatten())
        loss.backward()
    optim.zero_grad(set_to_none=True)
    return {"cp": cp, "method": method, "step_s": statistics.median(times), "act_bytes": tracker.peak - base}


def _pipeline(args, cp: int, m: int):
    """``(schedule, optimizer, shard)`` of the Llama on ``pp 2 x (cp or dp_shard) 2``, wired as
    examples/pipeline_setup.py does (CPWiring at cp 2)."""
    import argparse

    from examples.cp import CPWiring
    from shardwise.mesh import pipeline_mesh

    cpx = CPWiring.of(argparse.Namespace(cp=cp, cp_method="ring"))
    mesh = init_mesh(pp=2, cp=cp, device_type="cpu")
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq_len)
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    split = sw.pipeline_split(model, pipeline_mesh(mesh), cost="params", verbose=False)
    dp = cpx.shard_mesh(mesh, data_parallel_mesh(mesh))
    for st in split.stages:
        for blk in st.blocks:
            sw.fully_shard(blk, mesh=dp)
        sw.fully_shard(st.module, mesh=dp)
    cpx.wire(split, mesh, args.seq_len, torch.device("cpu"))
    loss = lambda out, tg: F.cross_entropy(out.flatten(0, 1), tg.flatten())  # noqa: E731
    sched = sw.PipelineSchedule(split, schedule="1f1b", microbatches=m, loss_fn=loss)
    return sched, torch.optim.AdamW(split.module.parameters(), lr=1e-3), cpx, mesh


def _measure_pp(args, cp: int, m: int = 2) -> dict:
    from examples.data import inputs_and_targets
    from examples.train import data_parallel_rank

    sched, optim, cpx, mesh = _pipeline(args, cp, m)
    dp_rank, dp_size = data_parallel_rank(mesh)

    def step(s: int, batch: int) -> None:
        tokens = local_slice(global_batch(s, batch, args.seq_len, args.vocab, 0), dp_rank, dp_size)
        sched.step(*cpx.shard(*inputs_and_targets(tokens)))
        optim.step()
        optim.zero_grad(set_to_none=True)

    step(0, 4)
    times = []
    for s in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(s + 1, 4)
        times.append(time.perf_counter() - t0)
    tracker = AllocationTracker()
    tracker.track(list(sched.split.module.parameters()), "params")
    tracker.track([t for st in optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)], "optim")
    base = tracker.current()
    with tracker:
        tokens = local_slice(global_batch(99, m * dp_size, args.seq_len, args.vocab, 0), dp_rank, dp_size)
        sched.step(*cpx.shard(*inputs_and_targets(tokens)))  # one sample per microbatch per dp group
    optim.zero_grad(set_to_none=True)
    peak = torch.tensor([tracker.peak - base], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    sched.close()
    return {"cp": cp, "method": f"pp2 x {'cp' if cp > 1 else 'dp'}2", "step_s": statistics.median(times),
            "act_bytes": int(peak.item())}


def _attention_bytes(args, cp, method) -> dict:
    mesh = init_mesh(cp=cp, device_type="cpu")
    cpm = cp_mesh(mesh)
    H, D, T = args.heads, args.dim // args.heads, args.seq_len // cp
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, T, D, generator=g).requires_grad_() for _ in range(3))
    counter = _P2PCounter()
    with counter:
        out = sw.context_parallel_attention(q, k, v, cpm.get_group(), is_causal=True, method=method)
        out.backward(torch.ones_like(out))
    K = 2 * q.numel() * q.element_size()
    G = 2 * q.numel() * 4
    theory = (cp - 1) * K + (cp - 1) * K + (cp * G if method == "ring" else (cp - 1) * G)
    return {"cp": cp, "method": method, "bytes": counter.p2p + counter.sent_bytes, "theory": theory}


def _torch_baseline(args) -> str:
    """torch's experimental context_parallel on this machine: 'ran' or why not."""
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_mesh(cp=4, device_type="cpu")
    q = torch.randn(1, args.heads, args.seq_len, args.dim // args.heads)
    try:
        with context_parallel(cp_mesh(mesh), buffers=[q], buffer_seq_dims=[2]):
            x = q.detach().requires_grad_()
            F.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
        return "ran"
    except Exception as e:  # a baseline that cannot run here is reported, not fatal
        return f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed()
    if world != 4:
        raise SystemExit("run on 4 ranks: torchrun --nproc-per-node 4 benchmarks/context_parallel.py")
    cps = [int(c) for c in args.cps.split(",")]
    rows = [_measure(args, cp, m) for cp in cps for m in (("ring", "allgather") if cp > 1 else ("ring",))]
    pp_rows = [_measure_pp(args, 1), _measure_pp(args, 2)] if args.pp_rows else []
    traffic = [_attention_bytes(args, cp, m) for cp in cps if cp > 1 for m in ("ring", "allgather")]
    baseline = _torch_baseline(args)
    if rank == 0:
        ref = rows[0]
        print(f"Llama dim {args.dim}, {args.layers} layers, {args.heads} heads, seq {args.seq_len}; 4 gloo ranks, "
              f"torch {torch.__version__}")
        print(f"{'cp':>3} {'method':>10} {'step s':>8} {'x cp=1':>7} {'act MiB':>8} {'x cp=1':>7}")
        for r in rows:
            print(f"{r['cp']:>3} {r['method']:>10} {r['step_s']:8.3f} {r['step_s'] / ref['step_s']:7.2f} "
                  f"{r['act_bytes'] / MB:8.1f} {r['act_bytes'] / ref['act_bytes']:7.2f}")
        for r in pp_rows:  # against the pipeline without cp (first pp row)
            print(f"{r['cp']:>3} {r['method']:>10} {r['step_s']:8.3f} {r['step_s'] / pp_rows[0]['step_s']:7.2f} "
                  f"{r['act_bytes'] / MB:8.1f} {r['act_bytes'] / pp_rows[0]['act_bytes']:7.2f}  (x pp2 x dp2)")
        print("bytes sent by one rank, one attention layer (forward + backward):")
        for t in traffic:
            print(f"  cp {t['cp']} {t['method']:>10}: {t['bytes'] / MB:8.2f} MiB, theory {t['theory'] / MB:8.2f} MiB "
                  f"({t['bytes'] / t['theory']:.3f})")
        print(f"torch experimental context_parallel (CPU/gloo): {baseline}")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "pp_rows": pp_rows, "traffic": traffic, "torch": baseline}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
