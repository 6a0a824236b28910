"""The ZB-H1 schedule: its action lists are complete and deadlock-free for any ``pp`` and ``m``; with
forward, input-gradient and weight-gradient times equal, its bubble is ``(p - 1) / (3 m + p - 1)``
(m >= p), a third of 1F1B's bubble time; its peak activations, from the memory walk, never exceed
1F1B's worst rank. Run by the runtime's split backward, it gives the gradients of one process (1e-6)
alone, with fully_shard (one all-gather and one reduce-scatter per unit per step, also with activation
checkpointing), with TP, at pp=4, and with units resharded between microbatches."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable import (SCHEDULES, ActionKind, activations_in_flight, build_schedule, simulate, stage_rank,
                                  theoretical_bubble)
from tests._dist import run_ranks
from tests.test_pipeline import _check, _run


@settings(deadline=None, max_examples=80)
@given(pp=st.integers(1, 8), m=st.integers(1, 24))
def test_zb_h1_is_complete_deadlock_free_and_a_third_of_1f1b(pp, m):
    acts = build_schedule("zb_h1", pp, m)
    makespan, busy = simulate(acts, pp, m, f_time=1, b_time=2, w_time=1)  # raises on a deadlock
    alive = activations_in_flight("zb_h1", pp, m).per_rank
    theory = theoretical_bubble(pp, m, schedule="zb_h1")
    for r, a in enumerate(acts):
        assert {x.kind for x in a} <= {ActionKind.F, ActionKind.I, ActionKind.W} and all(x.stage == r for x in a)
    one, one_busy = simulate(build_schedule("1f1b", pp, m), pp, m, f_time=1, b_time=2)
    assert makespan <= one, (makespan, one)
    assert max(alive) <= max(activations_in_flight("1f1b", pp, m).per_rank), alive
    if m >= pp:
        bubble = 1 - busy[0] / makespan
        assert abs(bubble - theory) < 1e-9, (bubble, theory)
        assert abs((makespan - 3 * m) * 3 - (one - 3 * m)) < 1e-9, (makespan, one)  # a third of the idle time


def test_zb_h1_at_pp4_m8():
    assert "zb_h1" in SCHEDULES
    makespan, busy = simulate(build_schedule("zb_h1", 4, 8), 4, 8)
    assert activations_in_flight("zb_h1", 4, 8).per_rank == (4, 4, 4, 4)
    assert (makespan, 1 - busy[0] / makespan) == (3 * 8 + 4 - 1, pytest.approx(3 / 27))  # 3m + p - 1


@pytest.mark.parametrize("world_size,opts", [
    (2, {}),
    (4, {"pp": 2, "dp_shard": 2, "ac": True, "clip": True}),
    (4, {"pp": 2, "tp": 2}),
    (4, {"pp": 4, "m": 8}),
], ids=["pp2", "pp2xfsdp-ac", "pp2xtp2", "pp4-m8"])
def test_zb_h1_matches_one_process(world_size, opts):
    res = run_ranks(_run, world_size, {"schedule": "zb_h1", **opts}, timeout=120)
    if opts.get("dp_shard"):  # gathered once, reduced once after the stage's last W: per unit per step
        assert all(r["all_gathers"] == r["units"] == 3 for r in res), res
    _check(res)


def test_zb_h1_units_resharded_between_microbatches():
    """Units that reshard after every forward are gathered again for each W (into the storage the
    kept graph points at); still one reduce-scatter per unit per step."""
    res = run_ranks(_run, 4, {"pp": 2, "dp_shard": 2, "schedule": "zb_h1", "between": True}, timeout=120)
    _check(res)


@settings(deadline=None, max_examples=40)
@given(pp=st.integers(1, 6), m=st.integers(1, 16), v=st.integers(1, 3))
def test_zbv_and_interleaved_zb_are_deadlock_free_within_their_memory_and_beat_1f1b(pp, m, v):
    """ZBV: two stages per rank in a V (rank r: stages r and 2p-1-r), at most 1F1B's p microbatches
    of the rank's layers alive; interleaved ZB: v stages per rank in a loop, interleaved 1F1B's cap.
    Both complete and deadlock-free (simulate raises otherwise), never slower than 1F1B (F = I = W),
    and ZBV never slower than ZB-H1."""
    one, _ = simulate(build_schedule("1f1b", pp, m), pp, m, f_time=1, b_time=2)
    zbv = build_schedule("zbv", pp, m, 2)
    assert all(stage_rank(a.stage, pp, "v") == r for r, acts in enumerate(zbv) for a in acts)
    mk, busy = simulate(zbv, 2 * pp, m, f_time=0.5, b_time=1, w_time=0.5)  # each of 2 stages: half the rank
    assert mk <= one + 1e-9 and mk <= simulate(build_schedule("zb_h1", pp, m), pp, m, w_time=1)[0] + 1e-9
    assert max(activations_in_flight("zbv", pp, m, 2).per_rank) <= pp
    izb = build_schedule("interleaved_zb", pp, m, v)
    mk, _ = simulate(izb, pp * v, m, f_time=1 / v, b_time=2 / v, w_time=1 / v)
    assert mk <= one + 1e-9
    alive = activations_in_flight("interleaved_zb", pp, m, v).per_rank
    for r in range(pp):
        assert alive[r] <= max(v, min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m)) / v + 1e-9, (r, alive)


def _loop_split_for_zbv(rank, world_size):
    import torch.nn.functional as F

    from shardwise.composable import PipelineSchedule, pipeline_split
    from tests.test_pipeline_agreement import Chain

    split = pipeline_split(Chain(), virtual_stages=2, cost="params", verbose=False)
    try:
        PipelineSchedule(split, schedule="zbv", microbatches=4, loss_fn=F.mse_loss)
    except ValueError as exc:
        return str(exc)
    return "built"


@settings(deadline=None, max_examples=40)
@given(pp=st.integers(1, 8), extra=st.integers(0, 12))
def test_dualpipev_is_deadlock_free_and_within_1f1b_memory_plus_one_stage(pp, extra):
    """DualPipeV (m >= 2p): complete and deadlock-free (simulate raises otherwise), its FB pairs' halves
    in the order their inputs arrive (tests/test_pipeline_pairs.py: in either order and together); peak activations at most p + 1/2 rank-units (1F1B's p and one half-rank
    stage); never slower than 1F1B, and as fast as ZBV within one unit."""
    m = 2 * pp + extra
    acts = build_schedule("dualpipev", pp, m, 2)
    assert all(stage_rank(a.stage, pp, "v") == r for r, lst in enumerate(acts) for a in lst)
    mk, _ = simulate(acts, 2 * pp, m, f_time=0.5, b_time=1, w_time=0.5)
    one, _ = simulate(build_schedule("1f1b", pp, m), pp, m)
    zbv, _ = simulate(build_schedule("zbv", pp, m, 2), 2 * pp, m, f_time=0.5, b_time=1, w_time=0.5)
    assert mk <= one + 1e-9 and mk <= zbv + 1 + 1e-9, (mk, one, zbv)
    assert max(activations_in_flight("dualpipev", pp, m, 2).per_rank) <= pp + 0.5 + 1e-9
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        build_schedule("dualpipev", pp, 2 * pp - 1, 2)


def test_zbv_needs_two_stages_per_rank_and_a_v_split():
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        build_schedule("zbv", 2, 4, 3)
    got = run_ranks(_loop_split_for_zbv, 2, timeout=60)
    assert len(set(got)) == 1 and "split it with pipeline_split(..., placement='v')" in got[0], got


@pytest.mark.parametrize("world_size,opts", [
    (2, {"schedule": "zbv", "v": 2, "placement": "v"}),
    (4, {"pp": 2, "dp_shard": 2, "schedule": "zbv", "v": 2, "placement": "v"}),
    (4, {"pp": 2, "tp": 2, "schedule": "zbv", "v": 2, "placement": "v"}),
    (2, {"schedule": "interleaved_zb", "v": 2}),
    (4, {"pp": 2, "dp_shard": 2, "schedule": "interleaved_zb", "v": 2}),
    (2, {"schedule": "dualpipev", "v": 2, "placement": "v"}),
    (4, {"pp": 2, "dp_shard": 2, "schedule": "dualpipev", "v": 2, "placement": "v", "ac": True}),
    (4, {"pp": 2, "tp": 2, "schedule": "dualpipev", "v": 2, "placement": "v"}),
], ids=["zbv-pp2", "zbv-pp2xfsdp", "zbv-pp2xtp2", "izb-pp2", "izb-pp2xfsdp", "dualpipev-pp2", "dualpipev-pp2xfsdp-ac",
        "dualpipev-pp2xtp2"])
def test_multi_stage_zero_bubble_matches_one_process(world_size, opts):
    res = run_ranks(_run, world_size, opts, timeout=120)
    if opts.get("dp_shard"):
        assert all(r["all_gathers"] == r["units"] for r in res), res
    _check(res)


def test_the_planner_and_suggest_mesh_know_the_zero_bubble_schedules():
    """plan_memory(pp=2) plans zbv in its V (rank 0 holds the embedding and the head) with the
    activations alive read off its lists; suggest_mesh takes the schedule by name."""
    import torch

    from examples.model import Llama, LlamaConfig
    from shardwise.composable import plan_memory, suggest_mesh

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=1000, dim=64, n_layers=8, n_heads=4))
    A = 64 * 2**20
    plans = {name: plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A, pp=2, microbatches=8, schedule=name,
                               kept_grads=0)  # the graph alone; the kept gradients: tests/test_pipeline_plan.py
             for name in ("zb_h1", "zbv", "interleaved_zb")}
    assert plans["zb_h1"].in_flight == activations_in_flight("zb_h1", 2, 8).per_rank == (2, 2)
    assert plans["zbv"].virtual_stages == plans["interleaved_zb"].virtual_stages == 2
    assert max(plans["zbv"].in_flight) <= 2 + 1e-9, plans["zbv"].in_flight  # at most 1F1B's p microbatches
    zbv = plan_memory(model, (1, 2), "FULL_SHARD", pp=2, microbatches=8, schedule="zbv")
    b = zbv.bounds  # 4 stages; the V gives rank 0 the first and the last (embedding and head)
    first_and_last = [f"layers.{i}" for i in [*range(b[0], b[1]), *range(b[3], b[4])]]
    assert [u.name for u in zbv.stages[0].units if u.name] == first_and_last, zbv.stages[0].units
    tight = suggest_mesh(model, hosts=2, gpus_per_host=1, bytes_per_gpu=2**30, activation_bytes=2 * 2**30,
                         pp_sizes=(1, 2), microbatches=8, schedule="zbv")
    assert tight.pp == 2, str(tight)


def test_simulate_with_per_action_costs():
    """``costs`` replaces the unit times per (kind, stage): the unit costs given explicitly change
    nothing, doubled they double the makespan, and a slow W on the last stage of zb_h1 only
    lengthens the tail (its Ws are off the critical path until the cool-down)."""
    acts = build_schedule("zb_h1", 2, 4)
    unit = {(k, s): t for s in range(2) for k, t in (("F", 1.0), ("I", 1.0), ("W", 1.0))}
    assert simulate(acts, 2, 4, f_time=1, b_time=2, w_time=1) == simulate(acts, 2, 4, costs=unit)
    double = simulate(acts, 2, 4, costs={k: 2 * t for k, t in unit.items()})
    assert double[0] == 2 * simulate(acts, 2, 4, costs=unit)[0]
    slow_w = simulate(acts, 2, 4, costs={**unit, ("W", 1): 1.5})
    assert slow_w[1][1] == 4 * (1 + 1 + 1.5) and slow_w[0] > 13
