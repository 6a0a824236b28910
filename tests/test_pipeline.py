"""Pipeline parallelism against one process on the whole batch: every schedule, uneven splits,
pp x fully_shard, pp x TP, and bad input (one error on every rank, no hang)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from examples.parallel import block_tp_plan
from shardwise.composable import PipelineError, PipelineSchedule, pipeline_split
from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh
from tests._compare import maxerr
from tests._dist import run_ranks

TOL = 1e-6
CFG = LlamaConfig(vocab_size=17, dim=16, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)
CFG6 = LlamaConfig(vocab_size=17, dim=16, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _ce_parallel(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(n=8, t=7, seed=1):
    tokens = torch.randint(0, CFG.vocab_size, (n, t + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tp_stage(stage, tp_mesh, tp):
    """TP the blocks of a stage (and the embedding / head where it holds them)."""
    from torch.distributed.tensor import Replicate, Shard
    # 7 tokens on 2 tp ranks: uneven sequence shards, shardwise's opt-in (uneven_shards=True)
    plan = {f"layers.{i}.{k}": v for i in stage.block_ids for k, v in block_tp_plan(sw, True, True).items()}
    if stage.is_first:
        plan["tok_embeddings"] = sw.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:
        # later stages get a sequence-sharded activation already
        pass
    if stage.is_last:
        plan["norm"] = sw.SequenceParallel(uneven_shards=True)
        plan["output"] = sw.ColwiseParallel(input_layouts=Shard(1), use_local_output=False, uneven_shards=True)
    sw.parallelize_module(stage.module, tp_mesh, plan)
    for i in stage.block_ids:
        att = stage.module.layers._modules[str(i)].attention
        att.n_heads //= tp
        att.n_kv_heads //= tp


def _checkpointed(block):
    from torch.utils.checkpoint import checkpoint

    forward = type(block).forward
    return lambda *a, **k: checkpoint(forward, block, *a, use_reentrant=False, **k)


def _run(rank, world_size, opts):
    pp = opts.get("pp", world_size)
    dp_shard, tp, v = opts.get("dp_shard", 1), opts.get("tp", 1), opts.get("v", 1)
    dp_rep = opts.get("dp_replicate", 1)
    cfg = opts.get("cfg", CFG)
    ref = Llama(cfg, generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(ref)
    inputs, targets = _batch(opts.get("batch", 8))
    ref_loss = _ce(ref(inputs), targets)
    ref_loss.backward()
    mesh = init_mesh(pp=pp, dp_replicate=dp_rep, dp_shard=dp_shard, tp=tp, device_type="cpu") if pp > 1 else None
    split = pipeline_split(model, pipeline_mesh(mesh) if mesh is not None else None, virtual_stages=v,
                           placement=opts.get("placement", "loop"),
                           cost=opts.get("cost", "params"), split_points=opts.get("split_points"),
                           sample=(lambda m: _ce(m(inputs), targets)) if opts.get("cost") == "time" else None,
                           verbose=False)
    if opts.get("ac"):  # activation checkpointing of every block (non-reentrant), as torchtitan does with PP
        for st in split.stages:
            for b in st.blocks:
                b.forward = _checkpointed(b)
    dp_rank, dp_size = 0, 1
    if mesh is not None and (dp_shard > 1 or tp > 1 or dp_rep > 1):
        for st in split.stages:
            if tp > 1:
                _tp_stage(st, mesh["tp"], tp)
            if dp_shard > 1 or dp_rep > 1:
                dp_mesh = data_parallel_mesh(mesh)
                for b in st.blocks:
                    sw.fully_shard(b, mesh=dp_mesh, **({"reshard_after_forward": opts["raf"]} if "raf" in opts else {}))
                sw.fully_shard(st.module, mesh=dp_mesh)
        dp_rank = mesh["dp_replicate"].get_local_rank() * dp_shard + mesh["dp_shard"].get_local_rank()
        dp_size = dp_shard * dp_rep
    per = inputs.shape[0] // dp_size
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    pairs: list = []

    def overlap(pair):  # opts["overlap"]: a user overlap function that runs the backward half first
        pairs.append(pair.action)
        pair.backward()
        pair.forward()

    sched = PipelineSchedule(split, schedule=opts.get("schedule", "1f1b"), microbatches=opts.get("m", 4),
                             loss_fn=_ce_parallel if tp > 1 else _ce,
                             loss_context=sw.loss_parallel if tp > 1 else None,
                             reduce_every_microbatch=opts.get("every", False),
                             reshard_between_microbatches=opts.get("between", False),
                             overlap=overlap if opts.get("overlap") else None)
    import shardwise.composable._fsdp._param_group as pgroup  # units all-gather with all_gather_single
    import shardwise.composable._fsdp._reduce as pg  # the reduction pipeline calls reduce_scatter_single
    calls, gathers = [0], [0]
    real, real_ag = pg.reduce_scatter_single, pgroup.all_gather_single

    def counting_ag(*a, **k):
        gathers[0] += 1
        return real_ag(*a, **k)

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    rep_calls = [0]
    real_ar = dist.all_reduce
    rep_group = mesh["dp_replicate"].get_group() if mesh is not None and dp_rep > 1 else None

    def counting_ar(*a, **k):
        if rep_group is not None and k.get("group") is rep_group:
            rep_calls[0] += 1
        return real_ar(*a, **k)

    states = [m._fsdp_state() for st in split.stages for m in st.module.modules() if isinstance(m, sw.FSDPModule)]
    settings = lambda: [(s.reshard_after_forward, s.reshard_after_backward, s.requires_gradient_sync)  # noqa: E731
                        for s in states]
    pg.reduce_scatter_single, pgroup.all_gather_single = counting, counting_ag
    dist.all_reduce = counting_ar
    try:
        losses = sched.step(inputs[sl], targets[sl])
        # as fully_shard set them: a default reshard_after_forward is True but on the root
        before = [((not s.is_root) if s.user_reshard_after_forward is None else s.user_reshard_after_forward, True, True)
                  for s in states]
        assert settings() == before, f"a pipeline step changed the units' settings: {before} -> {settings()}"
        gathers[0] = 0
        for p in split.module.parameters():
            p.grad = None
        sched.step(inputs[sl], targets[sl])  # a second step: its all-gathers are counted alone
    finally:
        pg.reduce_scatter_single, pgroup.all_gather_single = real, real_ag
        dist.all_reduce = real_ar
    assert settings() == before, f"a pipeline step changed the units' settings: {before} -> {settings()}"
    gathered = [s for s in states if s.group is not None and s.group.is_unsharded and s.reshard_after_backward]
    assert not gathered, f"{len(gathered)} unit(s) still hold gathered parameters after the step"
    units = sum(1 for s in states if s.group is not None)
    calls[0] //= 2
    rep_calls[0] //= 2
    loss = losses.mean()
    if dp_size > 1:
        t = torch.tensor([float(loss)], dtype=torch.float64)
        for axis in ("dp_replicate", "dp_shard"):
            dist.all_reduce(t, group=mesh[axis].get_group())
        loss = t[0] / dp_size
    norm_err = 0.0
    if opts.get("clip"):
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = sw.clip_grad_norm_(split.module.parameters(), 0.05, pp_mesh=split.pp_group)
        norm_err = abs(norm.item() - ref_norm.item()) / ref_norm.item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst, names = 0.0, []
    for n, p in split.module.named_parameters():
        g = _full(p.grad)
        r = ref_grads[n]
        worst = maxerr(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
        names.append(n)
    return {"loss_err": abs(float(loss) - ref_loss.item()) / ref_loss.item(), "grad_err": worst, "names": names,
            "bounds": split.plan.bounds, "reduce_scatters": calls[0], "units": units, "replica_all_reduces": rep_calls[0],
            "all_gathers": gathers[0],
            "norm_err": norm_err, "overlapped": [repr(a) for a in pairs],
            "pairs": [repr(a) for a in sched.actions if a.kind is sw.ActionKind.FB]}


def _check(results, per_step=1, cfg=CFG):
    names = set()
    for r in results:
        assert r["reduce_scatters"] == per_step * r["units"], f"{r['reduce_scatters']} reduce-scatters for {r['units']} units"
        assert r["loss_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        assert r["norm_err"] <= TOL, r
        names |= set(r["names"])
    ref = {n for n, _ in Llama(cfg).named_parameters()}
    assert names == ref, f"the stages together hold {sorted(names ^ ref)} differently from the unsplit model"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_matches_one_process(schedule):
    _check(run_ranks(_run, 2, {"schedule": schedule}, timeout=90))


def test_pp2_interleaved_matches_one_process():
    _check(run_ranks(_run, 2, {"schedule": "interleaved_1f1b", "v": 2}, timeout=90))


def test_pp4_1f1b_uneven_split_and_clip():
    res = run_ranks(_run, 4, {"pp": 4, "cfg": CFG6, "split_points": [1, 2, 5], "clip": True}, timeout=90)
    assert res[0]["bounds"] == (0, 1, 2, 5, 6)
    _check(res, cfg=CFG6)


def test_pp4_gpipe_measured_split():
    _check(run_ranks(_run, 4, {"pp": 4, "schedule": "gpipe", "cost": "time"}, timeout=90))


@pytest.mark.parametrize("every", [False, True])
def test_pp2_x_fsdp_one_reduce_scatter_per_unit_per_step(every):
    res = run_ranks(_run, 4, {"pp": 2, "dp_shard": 2, "every": every, "clip": not every}, timeout=90)
    assert all(r["units"] == 3 for r in res), res
    _check(res, per_step=4 if every else 1)


def test_pp2_x_tp2():
    _check(run_ranks(_run, 4, {"pp": 2, "tp": 2, "schedule": "interleaved_1f1b", "v": 2}, timeout=90))


def test_pp2_x_dp2_x_tp2_on_8_ranks():
    _check(run_ranks(_run, 8, {"pp": 2, "dp_shard": 2, "tp": 2, "schedule": "1f1b", "clip": True}, timeout=150))


class Chain(torch.nn.Module):
    """``head(layers(inp(x)))`` with Linear blocks of the given (in, out) widths."""

    def __init__(self, widths, splittable=True, between=None):
        super().__init__()
        self.between = between  # a function applied between blocks, outside them ([Note: work between blocks])
        self.inp = torch.nn.Linear(4, widths[0][0])
        blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh()) for a, b in widths)
        if splittable:
            self.layers = blocks
        else:
            self.body = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(widths[-1][1], 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in (self.layers if hasattr(self, "layers") else self.body):
            h = blk(h) if self.between is None else self.between(blk(h))
        return self.head(h)


def _bad(rank, world_size, case):
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    try:
        if case == "stages":
            split = pipeline_split(Chain([(8, 8)] * 3), virtual_stages=1, cost="params", verbose=False)
        elif case == "nolist":
            split = pipeline_split(Chain([(8, 8)] * 4, splittable=False), cost="params", verbose=False)
        else:
            widths = [(8, 8), (8, 8), (6, 8), (8, 8)] if case == "shapes" else [(8, 8)] * 4
            split = pipeline_split(Chain(widths, between=torch.tanh if case == "between" else None), cost="params",
                                   verbose=False)
            sched = PipelineSchedule(split, schedule="1f1b", microbatches=4, loss_fn=F.mse_loss)
            sched.step(x[:6] if case == "microbatches" else x, y[:6] if case == "microbatches" else y)
    except (ValueError, PipelineError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("case,text", [
    ("stages", "4 stages but the model has only 3 blocks to split"),
    ("nolist", "Chain has no splittable list of blocks"),
    ("microbatches", "inputs has batch size 6, not divisible by microbatches=4"),
    ("shapes", "pipeline stage 2 (pp rank 2) failed in forward of microbatch 0: RuntimeError: mat1 and mat2 shapes"),
    # h = tanh(block(h)) in the model's loop: the split would skip the tanh at each boundary (silently wrong)
    ("between", "pipeline stage 0 (pp rank 0) failed in forward of microbatch 0: ValueError: pipeline: stage 0's "
                "forward changes its last block's output outside a module"),
])
def test_bad_input_is_one_error_on_every_rank(case, text):
    got = run_ranks(_bad, 4, case, timeout=60)
    assert len(set(got)) == 1, f"ranks disagree: {got}"
    assert text in got[0] and "\n" not in got[0], got[0]


def test_one_rank_two_virtual_stages_hand_off_locally():
    _check(run_ranks(_run, 1, {"schedule": "interleaved_1f1b", "v": 2, "m": 2}, timeout=60))


def test_pp2_x_hsdp_one_replica_all_reduce_per_unit_per_step():
    res = run_ranks(_run, 4, {"pp": 2, "dp_replicate": 2, "schedule": "gpipe"}, timeout=90)
    for r in res:
        # a shard axis of one rank: the units' replica all-reduces share DDP-style buckets
        # ([Note: replica buckets] in _fsdp/_bucket.py); this stage's gradients fit the first
        # (1 MiB) bucket, so one all-reduce per step carries all 3 units, issued once per step
        assert r["units"] == 3 and r["replica_all_reduces"] == 1, r
    _check(res, per_step=0)  # a shard axis of one rank has nothing to reduce-scatter


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pp2_x_fsdp_gathers_once_per_unit_per_step(schedule):
    """[Note: fully_shard units in a pipeline step]: by default a unit all-gathers once per step (its parameters stay
    gathered from the first forward to the last backward of the stage), not twice per microbatch.
    Interleaved: two stages of one block per rank; the middle stage's root unit holds no
    parameters (the embedding and the head are on the first and last stage), so 3 units again."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    res = run_ranks(_run, 4, {"pp": 2, "dp_shard": 2, "schedule": schedule, "v": v}, timeout=90)
    for r in res:
        assert r["all_gathers"] == r["units"] == 3, r
    _check(res)


def test_pp2_x_fsdp_reshard_between_microbatches_and_explicit_setting():
    """``reshard_between_microbatches=True``: the blocks gather in every forward and backward (2 m
    per step) and the stage root, which keeps its parameters after forward, in every backward
    after the first (m); an explicit ``reshard_after_forward=True`` on the blocks is obeyed: they
    gather in every forward, and once more in backward (kept between the backwards)."""
    m = 4
    for opts, blocks, root in (({"between": True}, 2 * m, m), ({"raf": True}, m + 1, 1)):
        res = run_ranks(_run, 4, {"pp": 2, "dp_shard": 2, "schedule": "gpipe", **opts}, timeout=90)
        for r in res:
            assert r["all_gathers"] == 2 * blocks + root, (opts, r)  # 2 blocks + the stage root per rank
        _check(res)


def _accumulate_over_steps(rank, world_size, schedule):
    ref = Llama(CFG, generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(ref)
    inputs, targets = _batch(8)
    _ce(ref(inputs), targets).backward()
    mesh = init_mesh(pp=2, dp_shard=2, device_type="cpu")
    split = pipeline_split(model, pipeline_mesh(mesh), cost="params", verbose=False)
    dp = data_parallel_mesh(mesh)
    for st in split.stages:
        for b in st.blocks:
            sw.fully_shard(b, mesh=dp)
        sw.fully_shard(st.module, mesh=dp)
    sched = PipelineSchedule(split, schedule=schedule, microbatches=2, loss_fn=_ce)
    sl = slice(dp.get_local_rank() * 4, (dp.get_local_rank() + 1) * 4)
    import shardwise.composable._fsdp._reduce as pg
    real, calls = pg.reduce_scatter_single, []
    pg.reduce_scatter_single = lambda *a, **k: calls.append(1) or real(*a, **k)
    roots = [st.module for st in split.stages]
    try:
        for r in roots:
            r.set_requires_gradient_sync(False)  # FSDP2's accumulation over steps
        sched.step(inputs[sl], targets[sl])
        first = len(calls)
        unsharded = all(p.grad is None for p in split.module.parameters())
        for r in roots:
            r.set_requires_gradient_sync(True)
        sched.step(inputs[sl], targets[sl])
    finally:
        pg.reduce_scatter_single = real
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = maxerr(((_full(p.grad) - 2 * ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
                for n, p in split.module.named_parameters())
    return first, len(calls) - first, unsharded, worst


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_x_fsdp_accumulates_over_steps_with_gradient_sync_off(schedule):
    """A user's ``set_requires_gradient_sync(False)`` before a pipeline step holds for the whole
    step (no reduce-scatter, gradients kept unsharded); the next step with True reduces both
    steps' gradients once: twice the one-process gradient of the batch."""
    for first, second, unsharded, worst in run_ranks(_accumulate_over_steps, 4, schedule, timeout=90):
        assert first == 0 and unsharded, (first, unsharded)
        assert second == 3, second  # 2 blocks + the stage root
        assert worst <= TOL, worst


def _sharded_stages(policy=None):
    ref = Llama(CFG, generator=torch.Generator().manual_seed(0))
    mesh = init_mesh(pp=2, dp_shard=2, device_type="cpu")
    split = pipeline_split(copy.deepcopy(ref), pipeline_mesh(mesh), cost="params", verbose=False)
    dp = data_parallel_mesh(mesh)
    for st in split.stages:
        if policy is not None:
            sw.apply_fully_shard(st.module, dp, policy)
            continue
        for b in st.blocks:
            sw.fully_shard(b, mesh=dp)
        sw.fully_shard(st.module, mesh=dp)
    inputs, targets = _batch(8)
    sl = slice(dp.get_local_rank() * 4, (dp.get_local_rank() + 1) * 4)
    states = [m._fsdp_state() for st in split.stages for m in st.module.modules() if isinstance(m, sw.FSDPModule)]
    return ref, split, (inputs, targets, sl), [s for s in states if s.group is not None]


def _policy_units_gather_once(rank, world_size):
    _, split, (inputs, targets, sl), units = _sharded_stages(sw.ShardingPolicy("FULL_SHARD", layer_cls="TransformerBlock"))
    sched = PipelineSchedule(split, schedule="gpipe", microbatches=4, loss_fn=_ce)
    sched.step(inputs[sl], targets[sl])
    import shardwise.composable._fsdp._param_group as pgroup
    real, n = pgroup.all_gather_single, []
    pgroup.all_gather_single = lambda *a, **k: n.append(1) or real(*a, **k)
    try:
        sched.step(inputs[sl], targets[sl])
    finally:
        pgroup.all_gather_single = real
    return len(n), len(units)


def test_pp2_x_fsdp_policy_units_gather_once_per_step():
    """``apply_fully_shard`` with FULL_SHARD leaves the units' resharding at fully_shard's default,
    so a pipeline keeps them gathered between microbatches, as the planner plans."""
    for gathers, units in run_ranks(_policy_units_gather_once, 4, timeout=90):
        assert gathers == units == 3, (gathers, units)


class _RaiseAt:
    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, mod, args):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"boom at call {self.calls}")


def _failure_then_new_schedule(rank, world_size):
    ref, split, (inputs, targets, sl), units = _sharded_stages()
    params = list(split.module.parameters())  # what an optimizer holds
    hook = split.stages[0].blocks[0].register_forward_pre_hook(_RaiseAt(3)) if split.pp_rank == 1 else None
    sched = PipelineSchedule(split, schedule="1f1b", microbatches=4, loss_fn=_ce)
    try:
        sched.step(inputs[sl], targets[sl])
        return "no error"
    except PipelineError:
        pass
    left = {"plain tensors registered": sum(not isinstance(p, DTensor) for p in split.module.parameters()),
            "units gathered": sum(s.group.is_unsharded for s in units),
            "units with unsharded gradients": sum(s.group.has_unsharded_grads() for s in units)}
    sched.close()
    if hook is not None:
        hook.remove()
    for p in params:  # optimizer.zero_grad()
        p.grad = None
    PipelineSchedule(split, schedule="1f1b", microbatches=4, loss_fn=_ce).step(inputs[sl], targets[sl])
    _ce(ref(inputs), targets).backward()
    ref_grads = dict(ref.named_parameters())
    worst = maxerr(((_full(p.grad) - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
                for n, p in split.module.named_parameters())
    return left, worst


def test_pp2_x_fsdp_failed_step_reshards_and_drops_its_gradients():
    """A step that fails after two backwards leaves every unit resharded (its modules hold their
    shards, not gathered tensors) and none of the failed step's partial gradients; a new schedule
    then computes the one-process gradients."""
    for left, worst in run_ranks(_failure_then_new_schedule, 4, timeout=90):
        assert not any(left.values()), left
        assert worst <= TOL, worst


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_x_fsdp_with_activation_checkpointing(schedule):
    """Blocks recomputed in backward (activation checkpointing) inside pipelined, sharded stages:
    one-process gradients, still one all-gather and one reduce-scatter per unit per step."""
    res = run_ranks(_run, 4, {"pp": 2, "dp_shard": 2, "schedule": schedule, "ac": True, "clip": True}, timeout=90)
    for r in res:
        assert r["all_gathers"] == r["units"] == 3, r
    _check(res)
