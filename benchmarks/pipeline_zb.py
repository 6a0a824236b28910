"""Zero-bubble pipeline schedules: shardwise against torch.distributed.pipelining, their gain over
1F1B, and the measured bubble against `simulate`.

    python benchmarks/pipeline_zb.py --reps 6          # gloo ranks on CPU, one thread each

Parts (the Llama of ``examples/model.py``, same seed and batches; uniform split into ``p * v`` stages):

1. ``vs_torch`` (p=2, 2 ranks): shardwise ``1f1b`` / ``zbv`` / ``interleaved_zb`` (v=2) / ``dualpipev``
   against torch's ``Schedule1F1B`` / ``ScheduleZBVZeroBubble`` / ``ScheduleInterleavedZeroBubble`` /
   ``ScheduleDualPipeV`` on
   stage modules holding the same blocks (V placement for ZBV and DualPipeV), the same
   microbatches. Steps alternate between the two; a step's time is rank 0's wall time between
   two barriers; medians and the median of per-pair ratios shardwise / torch. The losses of the
   two are checked equal first.
2. ``gain`` (p=2 on 2 ranks, p=4 on 4 ranks; m=4 and 8): shardwise ``zb_h1`` and ``zbv`` against
   shardwise ``1f1b``, alternating: ratio of step times (below 1 is a gain), wall and CPU, and
   ``core_per_rank_ratio``: the ratio of `simulate`'s makespans with each schedule's measured
   per-action CPU times (what a core per rank would give, without communication).
3. ``memory`` (p=2, 2 ranks, m=8): per rank, the peak bytes of storages made during one step
   (`benchmarks.tracker.AllocationTracker`, tag ``new``: activations, kept graphs, transients;
   parameters and gradients tracked apart), per schedule against 1F1B's, beside the model's
   ratio from the action lists (`activations_in_flight`), without and with the kept frontier
   gradients (``kept_grads``: this rank's `PipelineSchedule.last_kept_grad_bytes` over the bytes
   autograd saves per microbatch, counted by a ``saved_tensors_hooks``).
4. ``bubble``: per schedule, the measured idle fraction ``1 - (compute + send) / step`` (mean over
   ranks, `PipelineSchedule.last_timing`: time in actions and issuing their sends is busy) against `simulate` of its action lists with forward, input-
   and weight-gradient times 1 (the mean idle fraction of the ranks), and (part 2) against
   `simulate` with each (kind, stage)'s measured mean CPU and wall times in that step
   (`PipelineSchedule.last_action_times`; ``costs_*`` lists the CPU ones in ms), and with the wall
   times plus ``comm_time``, one boundary message's latency measured by a ping-pong between the
   ranks before the steps (``message_latency_*``).

5. ``split`` (one process): CPU time per microbatch of the last stage's full backward ``B``
   against its ``I`` and ``W`` in the ``zb_h1`` order, alternating (the split backward's cost).

6. ``tuned`` (p=2): ``zb_h1`` / ``zbv`` / ``interleaved_zb`` as registered and refitted to their own
   measured step (`retune`: [Note: schedules tuned to measured costs]), against torch's schedule
   of the same name where there is one and against shardwise ``1f1b``, steps alternating.

7. ``order`` (p=2): torch's own ``zbv`` / ``interleaved_zb`` list (its ``pipeline_order``) replayed
   in shardwise's runtime, against torch running it and against shardwise's registered and
   refitted lists (what separates runtime from order), with `simulate`'s makespans of the three
   lists under the registered run's measured times.

8. ``build`` (one process): the time to build the ``interleaved_zb`` (and ``zbv``) lists of every
   rank at the sizes of `BUILD_SIZES`, shardwise's first `build_schedule` against torch's
   schedule constructor, alternating; CPU and wall seconds, ratio of medians.

On a machine with fewer cores than ranks the ranks share cores: wall times then mostly measure
the total work, and the measured bubble includes time a rank waits for a core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardwise.composable as sw  # noqa: E402
from benchmarks.pipeline import TorchStage, _batch, _ce, _timed  # noqa: E402
from examples.model import Llama, LlamaConfig  # noqa: E402

_TORCH = {"zbv": "ScheduleZBVZeroBubble", "interleaved_zb": "ScheduleInterleavedZeroBubble",
          "dualpipev": "ScheduleDualPipeV", "1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
          "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _v(schedule) -> int:
    spec = sw.get_schedule(schedule)
    return spec.exact_virtual_stages or (2 if spec.virtual else 1)


def _ours(cfg, pp, m, schedule, mesh=None):
    spec = sw.get_schedule(schedule)
    v = _v(spec)
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    split = sw.pipeline_split(model, mesh, virtual_stages=v, cost="params", placement=spec.placement,
                              split_points=list(sw.uniform_bounds(cfg.n_layers, pp * v)), verbose=False)
    return sw.PipelineSchedule(split, schedule=schedule, microbatches=m, loss_fn=_ce)


def _theirs(cfg, pp, m, schedule):
    import torch.distributed.pipelining as tp

    spec = sw.get_schedule(schedule)
    S = _v(spec) * pp
    bounds = sw.uniform_bounds(cfg.n_layers, S)
    rank = dist.get_rank()
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    mine = [s for s in range(S) if sw.stage_rank(s, pp, spec.placement) == rank]
    stages = [tp.PipelineStage(TorchStage(model, range(bounds[s], bounds[s + 1]), s == 0, s == S - 1), s, S,
                               torch.device("cpu")) for s in mine]
    cls = getattr(tp, _TORCH[schedule])
    return mine, cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=_ce)


def _run_theirs(mine, sched, x, y, S, losses=None):
    kw = {"target": y, "losses": losses if losses is not None else []} if S - 1 in mine else {}
    sched.step(*((x,) if 0 in mine else ()), **kw)


def _ratio(a, b, ca=None, cb=None) -> dict:
    out = {"shardwise_s": statistics.median(a), "other_s": statistics.median(b),
           "ratio": statistics.median(p / q for p, q in zip(a, b))}
    if ca:
        out.update({"shardwise_cpu_s": statistics.median(ca), "other_cpu_s": statistics.median(cb),
                    "cpu_ratio": statistics.median(p / q for p, q in zip(ca, cb))})
    return out


def _action_costs(sched, which: int = 1) -> dict:
    """The mean CPU (``which=1``) or wall (0) seconds of each (kind, stage) of actions in the last
    step, from every rank."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, {k: v[which] for k, v in sched.last_action_times.items()})
    return {k: v for d in got for k, v in d.items()}


def _simulated_with(schedule, pp, m, costs, makespan_only=False, comm_time=0.0) -> float:
    """`simulate`'s mean idle fraction of the ranks (or its makespan) with measured per-action times
    (and ``comm_time``: a message's measured latency between ranks)."""
    v = _v(schedule)
    makespan, busy = sw.simulate(sw.build_schedule(schedule, pp, m, v), pp * v, m, costs=costs, comm_time=comm_time)
    return makespan if makespan_only else 1 - sum(busy) / len(busy) / makespan


def _message_latency(shape, rounds: int = 24) -> float:
    """Seconds one stage-boundary message of ``shape`` (fp32) takes between two ranks: half the
    median round trip of a ping-pong between rank ``r`` and ``r ^ 1``, nothing else running."""
    import time

    rank = dist.get_rank()
    peer = rank ^ 1
    if peer >= dist.get_world_size():
        return 0.0
    t = torch.zeros(shape)
    trips = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        if rank % 2 == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def _measured_bubble(sched) -> tuple[float, float]:
    """The idle fraction, mean over ranks, two ways: not in an action nor issuing its sends; and
    waiting (for messages and, at the step's end, for the other ranks)."""
    lt = sched.last_timing
    t = torch.tensor([1 - (lt["compute_s"] + lt["send_s"]) / lt["step_s"], lt["wait_s"] / lt["step_s"]],
                     dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / dist.get_world_size(), float(t[1]) / dist.get_world_size()


def _bubble_row(bub: list) -> dict:
    idle, wait = [b[0] for b in bub], [b[1] for b in bub]
    return {"measured": statistics.median(idle), "measured_range": (min(idle), max(idle)),
            "measured_waiting": statistics.median(wait), "measured_waiting_range": (min(wait), max(wait))}


def _simulated(schedule, pp, m) -> float:
    v = _v(schedule)
    makespan, busy = sw.simulate(sw.build_schedule(schedule, pp, m, v), pp * v, m, f_time=1 / v, b_time=2 / v,
                                 w_time=1 / v)
    return 1 - sum(busy) / len(busy) / makespan


def bench_vs_torch(rank, world, args):
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    x, y = _batch(cfg, args.batch, args.seq, 1)
    out = {}
    for schedule in args.schedules.split(","):
        m = args.microbatches
        ours = _ours(cfg, 2, m, schedule)
        mine, theirs = _theirs(cfg, 2, m, schedule)
        for _ in range(2):
            got = ours.step(x, y)
            losses: list = []
            _run_theirs(mine, theirs, x, y, 2 * _v(schedule), losses)
            if losses:
                diff = max(abs(float(p) - float(q.detach())) for p, q in zip(got, losses))
                assert diff <= 1e-5 * abs(float(got[0])), f"{schedule}: the two runs compute different losses ({diff})"
        a, b, ca, cb, bub, sim = [], [], [], [], [], []
        latency = _message_latency((args.batch // m, args.seq, args.dim))
        for _ in range(args.reps):
            a.append(_timed(lambda: ours.step(x, y), ca))
            bub.append(_measured_bubble(ours))
            sim.append(_simulated_with(schedule, 2, m, _action_costs(ours, 0), comm_time=latency))
            b.append(_timed(lambda: _run_theirs(mine, theirs, x, y, 2 * _v(schedule)), cb))
        out[f"vs_torch_{schedule}_p2_m{m}"] = _ratio(a, b, ca, cb)
        out[f"bubble_{schedule}_p2_m{m}"] = {**_bubble_row(bub), "simulated": _simulated(schedule, 2, m),
                                             "simulated_wall_costs_and_latency": statistics.median(sim)}
        ours.close()
    return out


def bench_gain(rank, world, args):
    torch.set_num_threads(1)
    pp = world
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    out = {}
    for m in (4, 8):
        x, y = _batch(cfg, 2 * m, args.seq, 1)
        latency = _message_latency((2, args.seq, args.dim))  # one microbatch's boundary activation
        out[f"message_latency_p{pp}_m{m}_ms"] = latency * 1e3
        base = _ours(cfg, pp, m, "1f1b")
        for schedule in ("zb_h1", "zbv"):
            ours = _ours(cfg, pp, m, schedule)
            for _ in range(2):
                base.step(x, y)
                ours.step(x, y)
            a, b, ca, cb, bub, bub1, costs, costs1, walls, walls1, predicted, comm, comm1 = ([] for _ in range(13))
            for _ in range(args.reps):
                a.append(_timed(lambda: ours.step(x, y), ca))
                bub.append(_measured_bubble(ours))
                mine = _action_costs(ours)
                costs.append(_simulated_with(schedule, pp, m, mine))
                mine_wall = _action_costs(ours, 0)
                walls.append(_simulated_with(schedule, pp, m, mine_wall))
                comm.append(_simulated_with(schedule, pp, m, mine_wall, comm_time=latency))
                b.append(_timed(lambda: base.step(x, y), cb))
                bub1.append(_measured_bubble(base))
                theirs = _action_costs(base)
                costs1.append(_simulated_with("1f1b", pp, m, theirs))
                predicted.append(_simulated_with(schedule, pp, m, mine, True) / _simulated_with("1f1b", pp, m, theirs, True))
                base_wall = _action_costs(base, 0)
                walls1.append(_simulated_with("1f1b", pp, m, base_wall))
                comm1.append(_simulated_with("1f1b", pp, m, base_wall, comm_time=latency))
            out[f"gain_{schedule}_over_1f1b_p{pp}_m{m}"] = dict(_ratio(a, b, ca, cb),
                                                               core_per_rank_ratio=statistics.median(predicted))
            out[f"bubble_{schedule}_p{pp}_m{m}"] = {**_bubble_row(bub), "simulated": _simulated(schedule, pp, m),
                                                    "simulated_measured_costs": statistics.median(costs),
                                                    "simulated_measured_wall_costs": statistics.median(walls),
                                                    "simulated_wall_costs_and_latency": statistics.median(comm)}
            out[f"bubble_1f1b_p{pp}_m{m}"] = {**_bubble_row(bub1), "simulated": _simulated("1f1b", pp, m),
                                              "simulated_measured_costs": statistics.median(costs1),
                                              "simulated_measured_wall_costs": statistics.median(walls1),
                                              "simulated_wall_costs_and_latency": statistics.median(comm1)}
            out[f"costs_{schedule}_p{pp}_m{m}_ms"] = {f"{k}{s}": round(t * 1e3, 2)
                                                      for (k, s), t in sorted(_action_costs(ours).items())}
            out[f"costs_1f1b_p{pp}_m{m}_ms"] = {f"{k}{s}": round(t * 1e3, 2)
                                                for (k, s), t in sorted(_action_costs(base).items())}
            ours.close()
        base.close()
    return out


def _alternate(runs: dict, reps: int) -> dict:
    """Two untimed rounds of every step function, then ``reps`` timed rounds, the steps of each
    round in turn (`_timed`); the wall times by name."""
    for _ in range(2):
        for fn in runs.values():
            fn()
    times: dict = {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            times[k].append(_timed(fn))
    return times


def bench_tuned(rank, world, args):
    """Part 6 (p=2): each tunable schedule as registered, and refitted to its own measured step
    (`retune`, wall times, ``comm_time`` = the measured message latency), against torch's class of
    the same name (where there is one) and against shardwise ``1f1b``; steps alternate."""
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    m = args.microbatches
    x, y = _batch(cfg, args.batch, args.seq, 1)
    latency = _message_latency((args.batch // m, args.seq, args.dim))
    out: dict = {"tuned_message_latency_ms": latency * 1e3}
    base = _ours(cfg, 2, m, "1f1b")
    for schedule in [s for s in args.schedules.split(",") if s in sw.TUNABLE_SCHEDULES]:
        plain, tuned = _ours(cfg, 2, m, schedule), _ours(cfg, 2, m, schedule)
        for _ in range(2):
            tuned.step(x, y)
        tuned = sw.retune(tuned, comm_time=latency)
        runs = {"registered": lambda: plain.step(x, y), "tuned": lambda: tuned.step(x, y),
                "1f1b": lambda: base.step(x, y)}
        if schedule in _TORCH:
            mine, theirs = _theirs(cfg, 2, m, schedule)
            runs["torch"] = lambda: _run_theirs(mine, theirs, x, y, 2 * _v(schedule))
        times = _alternate(runs, args.reps)
        ratio = lambda a, b: statistics.median(p / q for p, q in zip(times[a], times[b]))  # noqa: E731
        res = {k: statistics.median(v) for k, v in times.items()}
        res.update({"tuned/registered": ratio("tuned", "registered"), "tuned/1f1b": ratio("tuned", "1f1b"),
                    "registered/1f1b": ratio("registered", "1f1b"), "summary": tuned.schedule.summary})
        if "torch" in runs:
            res.update({"tuned/torch": ratio("tuned", "torch"), "registered/torch": ratio("registered", "torch")})
        out[f"tuned_{schedule}_p2_m{m}"] = res
        plain.close()
        tuned.close()
    base.close()
    return out


def _torch_lists(theirs, S: int) -> list[list]:
    """torch's schedule's own per-rank order (``pipeline_order``) as shardwise actions."""
    out = []
    for r in range(len(theirs.pipeline_order)):
        out.append([sw.Action(a.computation_type.value, a.stage_index, a.microbatch_index)
                     for a in theirs.pipeline_order[r] if a is not None])
    return out


def bench_order(rank, world, args):
    """Part 7 (p=2): torch's own list for a schedule replayed in shardwise's runtime (a registered
    copy of the spec whose lists are torch's ``pipeline_order``), against torch running it, and
    against shardwise's registered and refitted lists; steps alternate."""
    import dataclasses

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    m = args.microbatches
    x, y = _batch(cfg, args.batch, args.seq, 1)
    out: dict = {}
    for schedule in [s for s in args.schedules.split(",") if s in ("zbv", "interleaved_zb")]:
        mine, theirs = _theirs(cfg, 2, m, schedule)
        lists = _torch_lists(theirs, 2 * _v(schedule))
        sw.register_schedule(dataclasses.replace(sw.get_schedule(schedule), name=f"torch_{schedule}",
                                                 build=lambda r, pp, mm, v, lists=lists: list(lists[r])), replace=True)
        plain, replay, tuned = (_ours(cfg, 2, m, n) for n in (schedule, f"torch_{schedule}", schedule))
        for _ in range(2):
            tuned.step(x, y)
        tuned = sw.retune(tuned)
        runs = {"registered": lambda: plain.step(x, y), "torch_list": lambda: replay.step(x, y),
                "tuned": lambda: tuned.step(x, y), "torch": lambda: _run_theirs(mine, theirs, x, y, 2 * _v(schedule))}
        times = _alternate(runs, args.reps)
        res = {f"{k}/torch": statistics.median(p / q for p, q in zip(v, times["torch"])) for k, v in times.items()
               if k != "torch"}
        wall = _action_costs(plain, 0)
        res["simulated_s"] = {k: sw.simulate(acts, 2 * _v(schedule), m, costs=wall)[0] for k, acts in
                              (("registered", plain.all_actions), ("torch_list", lists), ("tuned", tuned.all_actions))}
        out[f"order_{schedule}_p2_m{m}"] = res
        for sch in (plain, replay, tuned):
            sch.close()
        sw.unregister_schedule(f"torch_{schedule}")
    return out


def _saved_bytes_per_microbatch(sched, x, y) -> float:
    """Bytes autograd saves for one microbatch on this rank (distinct storages, parameters not
    counted): one step under a counting ``saved_tensors_hooks``, divided by ``m``."""
    params = {p.untyped_storage().data_ptr() for p in sched.split.module.parameters()}
    seen: dict[int, tuple] = {}  # storage address -> (bytes, the tensor: kept, so no address is reused)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sched.step(x, y)
    return sum(n for n, _ in seen.values()) / sched.m


def bench_memory(rank, world, args):
    from benchmarks.tracker import AllocationTracker

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    m = 8
    x, y = _batch(cfg, 2 * m, args.seq, 1)
    peaks, model, kept = {}, {}, {}
    for schedule in ("1f1b", "zb_h1", "zbv", "dualpipev"):
        ours = _ours(cfg, 2, m, schedule)
        ours.step(x, y)
        tr = AllocationTracker()
        tr.track(ours.split.module.parameters(), "params")
        tr.track([p.grad for p in ours.split.module.parameters()], "grads")
        with tr:
            ours.step(x, y)
        peaks[schedule] = tr.peak_by_tag.get("new", 0)
        saved = _saved_bytes_per_microbatch(ours, x, y)
        kept[schedule] = sum(ours.last_kept_grad_bytes.values()) / saved  # this rank's stages together
        spec = sw.get_schedule(schedule)
        v = spec.exact_virtual_stages or 1
        model[schedule] = {k: sw.activations_in_flight(schedule, 2, m, v, kept_grads=g).per_rank[rank]
                           for k, g in (("without", 0.0), ("with", kept[schedule] / v))}
        ours.close()
    return {f"memory_{s}_p2_m{m}_rank{rank}": {"new_bytes": peaks[s], "vs_1f1b": peaks[s] / peaks["1f1b"],
                                               "model_vs_1f1b": model[s]["without"] / model["1f1b"]["without"],
                                               "model_with_kept_grads_vs_1f1b": model[s]["with"] / model["1f1b"]["with"],
                                               "kept_grads": kept[s]} for s in peaks}


def bench_split(args) -> dict:
    """Part 5, one process: CPU ms per microbatch of the last stage's backward (blocks
    ``layers/2..`` + head + loss), a full ``B`` against ``I`` and ``W`` in the ``zb_h1`` order
    (one ``W`` pending), alternating; best and median of ``reps * 4`` microbatches."""
    import time

    import torch.nn.functional as F

    from benchmarks.pipeline import TorchStage
    from shardwise.composable._pipeline._split._graph_split import SplitCache
    from shardwise.composable._pipeline._split._split_backward import input_grad, weight_grad

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=4, max_seq_len=args.seq)
    model = Llama(cfg, generator=torch.Generator().manual_seed(0))
    stage = TorchStage(model, range(args.layers // 2, args.layers), False, True)
    _, y = _batch(cfg, 2, args.seq, 1)
    cache, got, clock = SplitCache(), {"B": [], "I": [], "W": []}, time.thread_time

    def fwd():
        x = torch.randn(2, args.seq, args.dim, requires_grad=True)
        return x, F.cross_entropy(stage(x).flatten(0, 1), y.flatten()) / 4

    for _ in range(args.reps * 10):
        for _ in range(4):
            x, loss = fwd()
            t0 = clock()
            loss.backward()
            got["B"].append(clock() - t0)
        pending = []
        for i in range(5):
            if i < 4:
                x, loss = fwd()
                t0 = clock()
                pending.append((x, input_grad([loss], [None], x, cache)[1]))
                got["I"].append(clock() - t0)
            if i >= 1:
                x0, p0 = pending.pop(0)
                t0 = clock()
                weight_grad(p0, x0)
                got["W"].append(clock() - t0)
    out = {f"split_{k}_ms": {"best": min(v) * 1e3, "median": statistics.median(v) * 1e3} for k, v in got.items()}
    out["split_I_plus_W_over_B"] = {f: (out["split_I_ms"][f] + out["split_W_ms"][f]) / out["split_B_ms"][f]
                                    for f in ("best", "median")}
    out["split_cache"] = {"hits": cache.hits, "misses": cache.misses}
    return out


BUILD_SIZES = ((8, 32, 4), (16, 32, 4), (32, 32, 4), (64, 128, 2), (64, 128, 4))
"""Part 8: ``(pp, m, v)`` of the build times (issue 33 item 11: pp=32, m=32, v=4 and pp=64, m=128)."""


def _torch_build(schedule: str, pp: int, m: int, v: int) -> None:
    """torch builds every rank's order (``pipeline_order``, then the lowering with sends and
    receives) when the schedule is made; rank 0's stages stand in for real ones (its
    constructor reads only their ranks, sizes and indices)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    ids = [0, 2 * pp - 1] if schedule == "zbv" else [k * pp for k in range(v)]
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v, submod=None, stage_index=i) for i in ids]
    getattr(schedules, _TORCH[schedule])(stages, m)


def _our_build(schedule: str, pp: int, m: int, v: int) -> None:
    """shardwise's first build in a process: the per-process cache of the lists emptied first."""
    from shardwise.composable._pipeline._schedules import _schedule_zbv

    _schedule_zbv._zbv_lists.cache_clear()
    _schedule_zbv._izb_lists.cache_clear()
    sw.build_schedule(schedule, pp, m, v)


def bench_build(args) -> dict:
    """Part 8, one process: the time to build the lists of every rank, shardwise's
    `build_schedule` (first build: cache emptied) against torch's ``ScheduleInterleavedZeroBubble``
    / ``ScheduleZBVZeroBubble`` constructor (which builds them for every rank too), alternating,
    ``reps`` times each; CPU (process) and wall seconds, best and median, and the ratio of the
    medians shardwise / torch."""
    import time

    out: dict = {}
    for schedule in [s for s in args.schedules.split(",") if s in ("zbv", "interleaved_zb")]:
        _torch_build(schedule, 4, 8, 2)  # imports and first calls out of the timings
        _our_build(schedule, 4, 8, 2)
        for pp, m, v in BUILD_SIZES:
            if schedule == "zbv" and v != 2:
                continue
            got: dict[str, dict[str, list[float]]] = {"ours": {"cpu": [], "wall": []}, "torch": {"cpu": [], "wall": []}}
            for _ in range(args.reps):
                for name, fn in (("torch", _torch_build), ("ours", _our_build)):
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn(schedule, pp, m, v)
                    got[name]["cpu"].append(time.process_time() - c0)
                    got[name]["wall"].append(time.perf_counter() - w0)
            res = {f"{name}_{k}_s": {"best": round(min(x), 3), "median": round(statistics.median(x), 3)}
                   for name, d in got.items() for k, x in d.items()}
            for k in ("cpu", "wall"):
                res[f"ours/torch_{k}"] = round(statistics.median(got["ours"][k]) / statistics.median(got["torch"][k]), 3)
            out[f"build_{schedule}_p{pp}_m{m}_v{v}"] = res
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", default="1f1b,zbv,interleaved_zb,dualpipev", help="part 1: comma list")
    p.add_argument("--parts", default="vs_torch,gain,memory", help="comma list of: vs_torch, gain, memory, split, tuned, order, build")
    p.add_argument("--worlds", default="2,4", help="part 2: comma list of rank counts (= pp)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from tests._dist import run_ranks

    res: dict = {}
    parts = args.parts.split(",")
    if "vs_torch" in parts:
        res.update(run_ranks(bench_vs_torch, 2, args, timeout=1800)[0])
    if "memory" in parts:
        for r in run_ranks(bench_memory, 2, args, timeout=1800):
            res.update(r)
    if "split" in parts:
        res.update(bench_split(args))
    if "order" in parts:
        res.update(run_ranks(bench_order, 2, args, timeout=1800)[0])
    if "tuned" in parts:
        res.update(run_ranks(bench_tuned, 2, args, timeout=1800)[0])
    if "build" in parts:
        res.update(bench_build(args))
    if "gain" in parts:
        for world in map(int, args.worlds.split(",")):
            res.update(run_ranks(bench_gain, world, args, timeout=1800)[0])
    for k, v in res.items():
        print(f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
