"""Schedules refitted to measured action times ([Note: schedules tuned to measured costs]):
`tune_schedule`'s lists are complete, deadlock-free, within the schedule's activation cap and never
longer than the registered list under the costs they were fitted to; `retune` on a running
pipeline gathers one set of costs for every rank and trains as one process does."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.composable as sw
from shardwise.composable import (TUNABLE_SCHEDULES, activations_in_flight, build_schedule, retune, simulate,
                                  tune_schedule)
from tests._dist import run_ranks

V = {"zb_h1": 1, "zbv": 2, "interleaved_zb": 2}
# measured on the example Llama (dim 128, p=2, ms): the first stage's I is empty, its W the whole backward
MEASURED = {("F", 0): 6.8, ("F", 1): 7.0, ("F", 2): 7.9, ("F", 3): 9.2, ("I", 0): 0.0, ("I", 1): 9.0,
            ("I", 2): 9.3, ("I", 3): 8.6, ("W", 0): 10.5, ("W", 1): 3.3, ("W", 2): 4.8, ("W", 3): 6.7}


def _cap_units(name, pp, m, v):
    """The schedule's cap in microbatch-units of a rank's blocks (as activations_in_flight counts)."""
    if name == "zbv":
        return [pp] * pp
    if name == "interleaved_zb":
        return [max(v, min(2 * (pp - r - 1) + (v - 1) * pp + 1, v * m)) / v for r in range(pp)]
    return [pp] * pp


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(TUNABLE_SCHEDULES), pp=st.integers(1, 4), extra=st.integers(0, 5), data=st.data(),
       comm=st.sampled_from([0.0, 0.05, 1.0]), trials=st.sampled_from([0, 60]))
def test_tuned_lists_are_valid_capped_and_never_longer(name, pp, extra, data, comm, trials):
    v = V[name]
    m = (pp * v if name != "zb_h1" else pp) + extra
    times = st.floats(0.0, 4.0, allow_nan=False)
    costs = {(k, s): data.draw(times) for s in range(pp * v) for k in "FIW"}
    spec = tune_schedule(name, pp, m, v, costs, comm_time=comm, max_trials=trials)
    tuned = spec.actions(pp, m, v)
    span, _ = simulate(tuned, pp * v, m, costs=costs, comm_time=comm)  # raises on a deadlock or a missing action
    registered, _ = simulate(build_schedule(name, pp, m, v), pp * v, m, costs=costs, comm_time=comm)
    assert span <= registered + 1e-9, (span, registered)
    assert spec.placement == sw.get_schedule(name).placement and spec.name == f"{name}:tuned"
    alive = activations_in_flight(spec, pp, m, v).per_rank
    assert all(a <= c + 1e-9 for a, c in zip(alive, _cap_units(name, pp, m, v))), (alive, name)


def _unit_play(name, pp, m, v):
    """The list scheduler's play at one unit per action (the registered lists before [Note: lists
    played on a model of real stages])."""
    from shardwise.composable._pipeline._schedules._schedule_greedy import greedy_lists
    from shardwise.composable._pipeline._schedules._schedule_zbv import izb_cap, zbv_cap

    cap = zbv_cap if name == "zbv" else izb_cap
    return greedy_lists(pp, m, v, "v" if name == "zbv" else "loop", cap(pp, m, v))


def test_unit_costs_keep_the_registered_lists_and_measured_ones_shorten_the_unit_play():
    for name in TUNABLE_SCHEDULES:
        v = V[name]
        unit = {(k, s): 1.0 for s in range(2 * v) for k in "FIW"}
        assert tune_schedule(name, 2, 4, v, unit).actions(2, 4, v) == build_schedule(name, 2, 4, v)
    for name, m in (("zbv", 4), ("zbv", 8), ("interleaved_zb", 4)):
        spec = tune_schedule(name, 2, m, 2, MEASURED, comm_time=0.3)  # with the local search
        tuned, _ = simulate(spec.actions(2, m, 2), 4, m, costs=MEASURED, comm_time=0.3)
        registered, _ = simulate(build_schedule(name, 2, m, 2), 4, m, costs=MEASURED, comm_time=0.3)
        played, _ = simulate(_unit_play(name, 2, m, 2), 4, m, costs=MEASURED, comm_time=0.3)
        assert tuned <= registered + 1e-9 and tuned < 0.95 * played, (name, m, tuned, registered, played)
        alive = activations_in_flight(spec, 2, m, 2).per_rank
        assert all(a <= c + 1e-9 for a, c in zip(alive, _cap_units(name, 2, m, 2))), alive


@settings(deadline=None, max_examples=25)
@given(name=st.sampled_from(["zbv", "interleaved_zb"]), pp=st.integers(1, 5), m=st.integers(1, 10),
       v=st.integers(2, 3))
def test_registered_lists_are_played_on_models_of_real_stages(name, pp, m, v):
    """[Note: lists played on a model of real stages]: the registered list is never longer than the
    unit-time play at unit times, nor in total over `STAGE_MODELS`."""
    from shardwise.composable._pipeline._schedules._schedule_zbv import STAGE_MODELS, _model

    v = 2 if name == "zbv" else v
    S = pp * v
    reg, play = build_schedule(name, pp, m, v), _unit_play(name, pp, m, v)
    assert simulate(reg, S, m)[0] <= simulate(play, S, m)[0] + 1e-9
    models = [_model(S, *x) for x in STAGE_MODELS]
    total = lambda acts: sum(simulate(acts, S, m, costs=c)[0] for c in models)  # noqa: E731
    assert total(reg) <= total(play) + 1e-9


@pytest.mark.parametrize("name", ["zbv", "interleaved_zb"])
def test_registered_lists_beat_the_unit_play_on_the_models(name):
    from shardwise.composable._pipeline._schedules._schedule_zbv import STAGE_MODELS, _model

    reg, play = build_schedule(name, 2, 4, 2), _unit_play(name, 2, 4, 2)
    models = [_model(4, *x) for x in STAGE_MODELS]
    total = lambda acts: sum(simulate(acts, 4, 4, costs=c)[0] for c in models)  # noqa: E731
    assert total(reg) < 0.98 * total(play), (total(reg), total(play))


def test_tune_schedule_refusals():
    with pytest.raises(ValueError, match="cannot be tuned"):
        tune_schedule("1f1b", 2, 4, 1, {})
    with pytest.raises(ValueError, match="missing I0, W0"):
        tune_schedule("zb_h1", 2, 4, 1, {("F", 0): 1.0, ("F", 1): 1.0})
    costs = {(k, s): 1.0 for s in range(2) for k in "FIW"}
    with pytest.raises(ValueError, match=">= 0"):
        tune_schedule("zb_h1", 2, 4, 1, {**costs, ("W", 1): -1.0})
    spec = tune_schedule("zb_h1", 2, 4, 1, costs)
    with pytest.raises(ValueError, match="tune again"):
        spec.actions(2, 8, 1)


def _retune(rank, world_size, opts):
    import torch.nn.functional as F

    from examples.model import Llama
    from shardwise.mesh import init_mesh, pipeline_mesh
    from tests.test_pipeline import CFG, _batch, _ce

    torch.manual_seed(0)
    ref = Llama(CFG, generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(ref)
    inputs, targets = _batch(8)
    F.cross_entropy  # noqa: B018
    name, v = opts["schedule"], V[opts["schedule"]]
    mesh = init_mesh(pp=2, device_type="cpu")
    split = sw.pipeline_split(model, pipeline_mesh(mesh), virtual_stages=v, placement=sw.get_schedule(name).placement,
                              cost="params", verbose=False)
    sched = sw.PipelineSchedule(split, schedule=name, microbatches=4, loss_fn=_ce)
    sched.step(inputs, targets)  # measures; its gradients are thrown away
    for p in split.module.parameters():
        p.grad = None
    skew = None
    if opts.get("skew"):  # costs that make the fitted lists differ from the registered ones
        skew = {(k, s): t for (k, s), t in MEASURED.items() if s < 2 * v}
    tuned = retune(sched, costs=skew, comm_time=0.3 if skew else 0.0)
    losses = tuned.step(inputs, targets)
    ref_loss = _ce(ref(inputs), targets)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    err = max(((p.grad - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
              for n, p in split.module.named_parameters())
    return {"loss_err": abs(float(losses.mean()) - ref_loss.item()) / ref_loss.item(), "grad_err": err,
            "lists": [repr(a) for a in tuned.actions], "all": [[repr(a) for a in acts] for acts in tuned.all_actions],
            "registered": [[repr(a) for a in acts] for acts in build_schedule(name, 2, 4, v)],
            "name": tuned.schedule.name}


@pytest.mark.parametrize("opts", [{"schedule": "zbv", "skew": True}, {"schedule": "zbv"},
                                  {"schedule": "zb_h1", "skew": True}], ids=["zbv-skewed", "zbv-measured", "zb_h1"])
def test_retune_trains_as_one_process_with_the_same_lists_on_every_rank(opts):
    res = run_ranks(_retune, 2, opts, timeout=120)
    for r in res:
        assert r["loss_err"] <= 1e-6 and r["grad_err"] <= 1e-6, r
        assert r["name"] == f"{opts['schedule']}:tuned"
    assert res[0]["all"] == res[1]["all"] and [r["lists"] for r in res] == res[0]["all"]
    if opts["schedule"] == "zbv" and opts.get("skew"):
        assert res[0]["all"] != res[0]["registered"]  # the skewed costs did change the order


def test_simulate_counts_comm_time_between_ranks_only():
    acts = build_schedule("1f1b", 2, 1)  # F0 -> F1 -> B1 -> B0: two messages
    assert simulate(acts, 2, 1, comm_time=0.5)[0] == simulate(acts, 2, 1)[0] + 1.0
    v = build_schedule("zbv", 2, 4, 2)  # stages 1 and 2 share rank 1: the turn of the V sends nothing
    one = simulate(v, 4, 4, costs={(k, s): 1.0 for s in range(4) for k in "FIW"}, comm_time=0.0)[0]
    assert simulate(v, 4, 4, comm_time=0.25)[0] > one
    single = [[a for acts in build_schedule("zbv", 1, 2, 2) for a in acts]]
    assert simulate(single, 2, 2, comm_time=9.0) == simulate(single, 2, 2)
