"""Pure tests of pipeline partitioning and schedules (no processes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable import balanced_bounds, uniform_bounds
from shardwise.composable._pipeline._split._partition import balanced_plan, plan_from_bounds
from shardwise.composable import SCHEDULES, Action, build_schedule, simulate, theoretical_bubble

COSTS = st.lists(st.integers(0, 50), min_size=1, max_size=9)


def _brute(costs, stages, pre, post):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = (0, *cuts, n)
        stage = [sum(costs[b[k]:b[k + 1]]) for k in range(stages)]
        stage[0] += pre
        stage[-1] += post
        best = max(stage) if best is None else min(best, max(stage))
    return best


@settings(deadline=None, max_examples=300)
@given(costs=COSTS, data=st.data(), pre=st.integers(0, 100), post=st.integers(0, 100))
def test_balanced_matches_brute_force(costs, data, pre, post) -> None:
    stages = data.draw(st.integers(1, len(costs)))
    b = balanced_bounds(costs, stages, pre=pre, post=post)
    assert len(b) == stages + 1 and b[0] == 0 and b[-1] == len(costs)
    assert all(b[k + 1] > b[k] for k in range(stages)), f"empty stage in {b}"
    plan = plan_from_bounds(costs, b, pre=pre, post=post)
    assert max(plan.costs) == _brute(costs, stages, pre, post), (costs, stages, pre, post, b)


def test_heavy_head_moves_blocks_off_the_last_stage() -> None:
    plan = balanced_plan([1.0] * 8, 2, pre=0.5, post=3.0)
    assert plan.bounds == (0, 5, 8) and plan.costs == (5.5, 6.0)
    assert uniform_bounds(8, 2) == (0, 4, 8) and uniform_bounds(7, 3) == (0, 3, 5, 7)
    assert "stage 1 rank 1: blocks 5..7 + post" in plan.describe(pp=2)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="4 stages but the model has only 3 blocks"):
        balanced_bounds([1, 1, 1], 4)
    with pytest.raises(ValueError, match="do not cut 4 blocks into non-empty contiguous stages"):
        plan_from_bounds([1, 1, 1, 1], [2, 2])
    assert plan_from_bounds([1, 2, 3, 4], [1, 3]).bounds == (0, 1, 3, 4)


@settings(deadline=None, max_examples=60)
@given(schedule=st.sampled_from([s for s in SCHEDULES if s in ("gpipe", "1f1b", "interleaved_1f1b")]),
       pp=st.integers(1, 5), mult=st.integers(1, 4), v=st.integers(2, 3), extra=st.integers(0, 3))
def test_schedules_are_complete_deadlock_free_and_hit_the_theory(schedule, pp, mult, v, extra) -> None:
    """The schedules of F and B actions; the zero-bubble ones are checked in tests/test_pipeline_zb.py."""
    if schedule != "interleaved_1f1b":
        v = 1
        m = mult + extra
    else:
        m = pp * mult
    acts = build_schedule(schedule, pp, m, v)
    makespan, busy = simulate(acts, pp * v, m)
    for r, a in enumerate(acts):
        assert all(x.stage % pp == r for x in a), f"rank {r} runs a stage it does not hold: {a}"
        alive = peak = 0
        for x in a:
            alive += 1 if x.kind == "F" else -1
            peak = max(peak, alive)
        if schedule == "1f1b":
            assert peak <= min(pp - r, m), f"1f1b keeps {peak} microbatches alive on rank {r}"
    bubble = 1 - busy[0] / makespan
    assert abs(bubble - theoretical_bubble(pp, m, v)) < 1e-9, (bubble, theoretical_bubble(pp, m, v))


def test_schedule_errors_and_a_bad_order() -> None:
    with pytest.raises(ValueError, match="multiple of pp"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown"):
        build_schedule("zb", 2, 4)
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad, 2, 1)


def _meta_llama(**kw):
    import torch

    from examples.model import Llama, LlamaConfig
    with torch.device("meta"):
        return Llama(LlamaConfig(**kw))


def test_plan_memory_per_stage_and_schedule_activations() -> None:
    from shardwise.composable import plan_memory
    model = _meta_llama(vocab_size=1000, dim=64, n_layers=8, n_heads=4)
    A = 64 * 2**20
    flat = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A)
    one = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A, pp=2, microbatches=8)
    gp = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A, pp=2, microbatches=8, schedule="gpipe")
    share = [len(range(one.bounds[s], one.bounds[s + 1])) / 8 for s in range(2)]
    assert [p.activations for p in one.stages] == [int(A * share[0] * 2 / 8), int(A * share[1] * 1 / 8)]
    assert [p.activations for p in gp.stages] == [int(A * share[0]), int(A * share[1])]
    assert sum(p.params for p in one.stages) <= flat.params * 1.01 + 4096  # each stage holds only its part
    assert one.peak < flat.peak and "stage 0 blocks" in str(one)
    # by default a stage's units stay gathered for the step ([Note: fully_shard units in a pipeline step]): every
    # block's gathered parameters count at the peak; reshard_between_microbatches gathers 1-2 at a time
    between = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A, pp=2, microbatches=8,
                          reshard_between_microbatches=True)
    zero2 = plan_memory(model, (1, 2), "SHARD_GRAD_OP", activation_bytes=A, pp=2, microbatches=8)
    assert [p.peak for p in one.stages] == [p.peak for p in zero2.stages]
    assert all(a.peak < b.peak for a, b in zip(between.stages, one.stages)), (between, one)


def test_plan_memory_counts_what_a_split_backward_keeps() -> None:
    """A zero-bubble schedule holds, from each I to its W, the gradients at the frontier nodes
    ([Note: activations in flight]): the planner counts them (by default DEFAULT_KEPT_GRADS per
    microbatch-unit), as activations_in_flight's kept_grads does, and not for 1F1B."""
    from shardwise.composable import activations_in_flight, plan_memory
    from shardwise.composable import DEFAULT_KEPT_GRADS
    model = _meta_llama(vocab_size=1000, dim=64, n_layers=8, n_heads=4)
    A, m = 64 * 2**20, 8
    kw = dict(activation_bytes=A, pp=2, microbatches=m)
    one = plan_memory(model, (1, 2), "FULL_SHARD", **kw)
    zb = plan_memory(model, (1, 2), "FULL_SHARD", schedule="zb_h1", **kw)
    zb0 = plan_memory(model, (1, 2), "FULL_SHARD", schedule="zb_h1", kept_grads=0, **kw)
    zbk = plan_memory(model, (1, 2), "FULL_SHARD", schedule="zb_h1", kept_grads=0.3, **kw)
    assert one.kept_grads == 0 and zb.kept_grads == DEFAULT_KEPT_GRADS and zbk.kept_grads == 0.3
    share = [len(range(zb.bounds[s], zb.bounds[s + 1])) / 8 for s in range(2)]
    for plan, k in ((zb, DEFAULT_KEPT_GRADS), (zb0, 0.0), (zbk, 0.3)):
        alive = activations_in_flight("zb_h1", 2, m, kept_grads=k).per_rank
        assert plan.in_flight == alive
        assert [p.activations for p in plan.stages] == [int(A * share[r] * alive[r] / m) for r in range(2)]
    # the last rank keeps gradients while W waits: more than without them, and more than 1F1B
    assert zb.stages[1].activations > zbk.stages[1].activations > zb0.stages[1].activations
    assert zb0.stages[1].activations >= one.stages[1].activations
    assert "kept gradients 0.62" in str(zb) and "kept" not in str(one)
    v = plan_memory(model, (1, 2), "FULL_SHARD", schedule="zbv", **kw)
    assert v.kept_grads == DEFAULT_KEPT_GRADS and v.virtual_stages == 2
    for bad in (-1, "big", True):
        with pytest.raises(ValueError, match="kept_grads="):
            plan_memory(model, (1, 2), "FULL_SHARD", schedule="zb_h1", kept_grads=bad, **kw)


def test_suggest_mesh_uses_a_pipeline_only_when_needed() -> None:
    from shardwise.composable import suggest_mesh
    model = _meta_llama(vocab_size=1000, dim=256, n_layers=8, n_heads=4)
    roomy = suggest_mesh(model, hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, pp_sizes=(1, 2))
    assert roomy.pp == 1
    tight = suggest_mesh(model, hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, activation_bytes=2 * 2**30,
                         pp_sizes=(1, 2), microbatches=8)
    assert tight.pp == 2 and "pp=2" in str(tight), str(tight)
    with pytest.raises(ValueError, match="must divide hosts"):
        suggest_mesh(model, hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, pp_sizes=(3,))
    # a zero-bubble schedule's kept gradients count: zb_h1 plans more than 1F1B on the same mesh
    kw = dict(hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, activation_bytes=2 * 2**30, pp_sizes=(2,),
              microbatches=8)
    zb = suggest_mesh(model, schedule="zb_h1", **kw)
    assert zb.pp == 2 and zb.plan.peak > tight.plan.peak
    assert suggest_mesh(model, schedule="zb_h1", kept_grads=0, **kw).plan.peak < zb.plan.peak


class _Tied(__import__("torch").nn.Module):
    def __init__(self, tie: bool):
        import torch
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for blk in self.layers:
            h = blk(h)
        return self.head(h)


def test_split_refusals_without_processes() -> None:
    from shardwise.composable import pipeline_split
    with pytest.raises(ValueError, match="shared between modules that land on different stages"):
        pipeline_split(_Tied(True), cost="params", verbose=False)
    with pytest.raises(ValueError, match=r"split_points \[1\] make 2 stages, but pp \(1\) x virtual_stages \(1\) = 1"):
        pipeline_split(_Tied(False), cost="params", split_points=[1], verbose=False)
    with pytest.raises(ValueError, match="needs sample="):
        pipeline_split(_Tied(False), cost="time", verbose=False)
    split = pipeline_split(_Tied(False), virtual_stages=3, cost="params", verbose=False)
    assert split.plan.bounds == (0, 1, 2, 3) and [s.is_first for s in split.stages] == [True, False, False]
    assert {n for n, _ in split.module.named_parameters()} == {n for n, _ in _Tied(False).named_parameters()}


def test_suggest_mesh_counts_one_gather_per_unit_in_a_pipeline() -> None:
    """A pipeline stage gathers every unit once per step, FULL_SHARD or not: the traffic
    `suggest_mesh` ranks layouts by is then SHARD_GRAD_OP's; without a pipeline FULL_SHARD
    gathers the blocks twice (forward and backward)."""
    from shardwise.composable import plan_memory
    from shardwise.composable._plan._planner import _comm
    model = _meta_llama(vocab_size=1000, dim=64, n_layers=8, n_heads=4)
    full, zero2 = (plan_memory(model, (1, 4), s) for s in ("FULL_SHARD", "SHARD_GRAD_OP"))
    args = (8, 1, 100e9, 25e9)
    assert _comm(full, *args, gather_once=True) == _comm(zero2, *args) == _comm(zero2, *args, gather_once=True)
    assert _comm(full, *args)[0] > _comm(zero2, *args)[0]


def test_plan_memory_counts_gradients_summed_over_microbatches() -> None:
    """A stage sums every unit's unsharded gradient over the microbatches (in fp32 under bf16
    parameters with an fp32 reduction): ``accumulated_grads`` holds those the single-backward
    model does not count yet (all units but the largest and the root; and the wider dtype)."""
    import torch

    from shardwise.composable import MixedPrecisionPolicy, plan_memory
    model = _meta_llama(vocab_size=1000, dim=64, n_layers=8, n_heads=4)
    plan = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8)
    for st in plan.stages:
        root, blocks = st.units[-1], st.units[:-1]
        largest = max(blocks, key=lambda u: u.unsharded)
        assert st.accumulated_grads == sum(u.unsharded_grads for u in blocks) - largest.unsharded_grads
        assert st.accumulated_grads > 0 and st.peak >= st.end_of_backward
    assert all(s.accumulated_grads == 0 for s in plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=1).stages)
    assert all(s.accumulated_grads == 0 for s in plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8,
                                                             reduce_every_microbatch=True).stages)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, mp_policy=mp)
    for s in bf16.stages:  # bf16 grads (half of fp32's), summed in fp32: all of them count twice
        root, blocks = s.units[-1], s.units[:-1]
        largest = max(blocks, key=lambda u: u.unsharded)
        rest = sum(u.unsharded_grads for u in blocks) - largest.unsharded_grads
        assert s.accumulated_grads == 2 * rest + largest.unsharded_grads + root.unsharded_grads
