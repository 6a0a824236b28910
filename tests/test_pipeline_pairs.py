"""Forward/backward pairs (``FB`` actions): dualpipev's steady state is made of them, their halves
never wait on each other (so either order, or both together, is deadlock-free), `simulate`
times them (and messages, with ``comm_time``), the runtime runs the half whose input is there
first, and a user's overlap function runs each pair once without changing any number."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from shardwise.composable import (Action, ActionKind, PipelineError, PipelineSchedule, ScheduleSpec,
                                  activations_in_flight, build_schedule, get_schedule, pipeline_split, simulate,
                                  stage_rank)
from tests._dist import run_ranks
from tests.test_pipeline import _check, _run
from tests.test_pipeline_registry import Chain, _registered

FB = ActionKind.FB


def _unpaired(acts, backward_first: bool):
    """The lists with every pair cut into its two halves, forward first or backward first."""
    return [[h for a in lst for h in (a.halves[::-1] if backward_first else a.halves)] for lst in acts]


@pytest.mark.parametrize("pp,m", [(p, m) for p in range(1, 7) for m in range(2 * p, 3 * p + 3)])
def test_dualpipev_pairs_are_deadlock_free_in_either_order_and_together(pp, m):
    """Every (p, m) with p in 1..6, m in 2p..3p+2: the steady state's pairs are FB actions of one
    forward and one full backward of the rank's two stages; `simulate` runs the lists with the
    halves in arrival order, run together (overlap 0 and 1), and cut into F-then-B or B-then-F:
    never a deadlock, so the runtime's order, whichever arrives first, cannot deadlock either."""
    acts = build_schedule("dualpipev", pp, m, 2)
    for r, lst in enumerate(acts):
        pairs = [a for a in lst if a.kind is FB]
        assert len(pairs) == 2 * (m - 2 * pp + r + 1) + (pp - r - 1), (r, pairs)
        for a in pairs:
            f, b = a.halves
            assert f.kind is ActionKind.F and b.kind is ActionKind.B and f.stage != b.stage, a
            assert all(stage_rank(h.stage, pp, "v") == r for h in a.halves), (r, a)
    times = {"f_time": 0.5, "b_time": 1, "w_time": 0.5}
    arrival, busy = simulate(acts, 2 * pp, m, **times)
    together, _ = simulate(acts, 2 * pp, m, overlap=1.0, **times)
    serial, serial_busy = simulate(acts, 2 * pp, m, overlap=0.0, **times)
    assert together <= serial + 1e-9 and busy == serial_busy
    for backward_first in (False, True):
        simulate(_unpaired(acts, backward_first), 2 * pp, m, **times)  # raises on a deadlock
    forward_first, _ = simulate(_unpaired(acts, False), 2 * pp, m, **times)
    assert arrival <= forward_first + 1e-9, (arrival, forward_first)  # the one that is there first never delays


def _dualpipev_unpaired(rank: int, pp: int, m: int, v: int) -> list[Action]:
    return [h for a in get_schedule("dualpipev").build(rank, pp, m, v) for h in a.halves]


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (3, 7), (4, 11)])
def test_the_memory_walk_counts_a_pair_as_its_forward_then_its_backward(pp, m):
    spec = ScheduleSpec("dualpipev_unpaired", _dualpipev_unpaired, virtual=True, placement="v", exact_virtual_stages=2)
    with _registered(spec):
        for kept in (0.0, 0.5):
            assert (activations_in_flight("dualpipev", pp, m, 2, kept_grads=kept)
                    == activations_in_flight("dualpipev_unpaired", pp, m, 2, kept_grads=kept))


def test_a_pair_is_one_hashable_action_with_two_halves():
    f, b = Action("F", 3, 1), Action("B", 0, 0)
    p = Action.pair(f, b)
    assert p.kind is FB and p.halves == (f, b) and (p.stage, p.microbatch) == (3, 1) and repr(p) == "F3.1&B0.0"
    assert hash(p) == hash(Action.pair(Action("F", 3, 1), Action("B", 0, 0))) and p != f and f.halves == (f,)
    with pytest.raises(ValueError, match="a forward and a backward"):
        Action.pair(b, f)
    with pytest.raises(ValueError, match="two \\(stage, microbatch\\)s"):
        Action.pair(Action("F", 0, 0), Action("I", 0, 0))
    with pytest.raises(ValueError, match="only a pair"):
        Action("F", 0, 0, (f, b))


def _bad_pair(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """p=2: rank 0 pairs F0.1 with B0.0, whose gradient rank 1 sends only after F1.1, which
    needs F0.1's activation: the backward half waits on the forward half through rank 1."""
    if rank == 0:
        return [Action("F", 0, 0), Action.pair(Action("F", 0, 1), Action("B", 0, 0)), Action("B", 0, 1)]
    return [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]


def _far_pair(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Rank 0 of two pairs its forward with rank 1's backward."""
    if rank == 0:
        return [Action("F", 0, 0), Action.pair(Action("F", 0, 1), Action("B", 1, 0)), Action("B", 0, 0)]
    return [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1)]


def test_pairs_whose_halves_wait_on_each_other_or_span_ranks_are_refused():
    acts = [_bad_pair(r, 2, 2, 1) for r in range(2)]
    with pytest.raises(ValueError, match="must not wait on each other"):
        simulate(acts, 2, 2)
    simulate(_unpaired(acts, False), 2, 2)  # as two actions, forward first, it runs
    with _registered(ScheduleSpec("far_pair", _far_pair)), pytest.raises(ValueError, match="does not hold both"):
        build_schedule("far_pair", 2, 2)


def test_simulate_comm_time_and_pair_costs():
    """``comm_time``: 1F1B at p=2, m=1 grows by 2c (one activation, one gradient); zbv at p=2,
    m=1 by 4c, not 6c: the V's turn (stage 1 to 2 and back, both on rank 1) is a hand-off on one
    rank. A pair costs its halves (busy time unchanged), overlapped it costs the longer half."""
    for c in (0.25, 1.0):
        base, _ = simulate(build_schedule("1f1b", 2, 1), 2, 1)
        assert simulate(build_schedule("1f1b", 2, 1), 2, 1, comm_time=c)[0] == pytest.approx(base + 2 * c)
        zbv = build_schedule("zbv", 2, 1, 2)
        assert simulate(zbv, 4, 1, comm_time=c)[0] == pytest.approx(simulate(zbv, 4, 1)[0] + 4 * c)
    one = [[Action("F", 0, 0), Action("F", 1, 0), Action.pair(Action("F", 0, 1), Action("B", 1, 0)),
            Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 0), Action("B", 0, 1)]]  # one rank, two stages
    costs = {("F", 0): 1.0, ("F", 1): 1.0, ("B", 0): 3.0, ("B", 1): 2.0}
    mk, busy = simulate(one, 2, 2, costs=costs)
    assert mk == busy[0] == 4 * 1.0 + 2 * 2.0 + 2 * 3.0
    mk, busy = simulate(one, 2, 2, costs=costs, overlap=1.0)
    assert mk == busy[0] == 4 * 1.0 + 2 * 2.0 + 2 * 3.0 - 1.0  # F0.1 hidden behind B1.0
    assert simulate(one, 2, 2, costs=costs, overlap=0.5)[0] == 13.5
    with pytest.raises(ValueError, match="overlap=2"):
        simulate(one, 2, 2, overlap=2)
    with pytest.raises(ValueError, match="comm_time=-1"):
        simulate(one, 2, 2, comm_time=-1)


def test_simulate_runs_the_half_that_is_ready_first():
    """Rank 0's pair (F3.1 & B0.0) with comm_time: B0.0's gradient is there before F3.1's
    activation when rank 1 sends it first, so the backward goes first and the makespan is that
    of the list with the halves swapped by hand."""
    v_grad_first = _v_schedule(0, 2, 2, 2, "grad"), _v_schedule(1, 2, 2, 2, "grad")
    got = simulate(list(v_grad_first), 4, 2, comm_time=0.5)
    assert got == simulate(_unpaired(list(v_grad_first), True), 4, 2, comm_time=0.5)
    assert got[0] < simulate(_unpaired(list(v_grad_first), False), 4, 2, comm_time=0.5)[0]


def _v_schedule(rank: int, pp: int, m: int, v: int, first: str = "grad") -> list[Action]:
    """p=2, m=2 in a V (rank 0: stages 0 and 3, rank 1: 1 and 2). Rank 0 pairs F3.1 with B0.0,
    both fed by rank 1, which sends the gradient of B0.0 before the activation of F3.1
    (``first="grad"``) or after it (``"act"``)."""
    if rank == 0:
        return [Action("F", 0, 0), Action("F", 0, 1), Action("F", 3, 0), Action("B", 3, 0),
                Action.pair(Action("F", 3, 1), Action("B", 0, 0)), Action("B", 3, 1), Action("B", 0, 1)]
    head = [Action("F", 1, 0), Action("F", 2, 0), Action("F", 1, 1)]
    grads = [Action("B", 2, 0), Action("B", 1, 0)]
    tail = [Action("B", 2, 1), Action("B", 1, 1)]
    return head + (grads + [Action("F", 2, 1)] if first == "grad" else [Action("F", 2, 1)] + grads) + tail


def _v_grad(rank, pp, m, v):
    return _v_schedule(rank, pp, m, v, "grad")


def _v_act(rank, pp, m, v):
    return _v_schedule(rank, pp, m, v, "act")


def _loop3(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """p=3, m=2: the middle rank pairs F1.1 (fed by rank 0) with B1.0 (fed by rank 2)."""
    if rank == 1:
        return [Action("F", 1, 0), Action.pair(Action("F", 1, 1), Action("B", 1, 0)), Action("B", 1, 1)]
    return [Action("F", rank, 0), Action("F", rank, 1), Action("B", rank, 0), Action("B", rank, 1)] if rank == 0 else [
        Action("F", 2, 0), Action("B", 2, 0), Action("F", 2, 1), Action("B", 2, 1)]


def _v_split(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """p=2, m=2 in a V; rank 0 pairs F0.1 with the input-gradient half I3.0 (its W later)."""
    if rank == 0:
        return [Action("F", 0, 0), Action("F", 3, 0), Action.pair(Action("F", 0, 1), Action("I", 3, 0)),
                Action("W", 3, 0), Action("F", 3, 1), Action("B", 3, 1), Action("B", 0, 0), Action("B", 0, 1)]
    return [Action("F", 1, 0), Action("F", 2, 0), Action("F", 1, 1), Action("B", 2, 0), Action("B", 1, 0),
            Action("F", 2, 1), Action("B", 2, 1), Action("B", 1, 1)]


SPECS = {"v_split": ScheduleSpec("v_split", _v_split, virtual=True, placement="v"),
         "v_grad": ScheduleSpec("v_grad", _v_grad, virtual=True, placement="v"),
         "v_act": ScheduleSpec("v_act", _v_act, virtual=True, placement="v"),
         "loop3": ScheduleSpec("loop3", _loop3), "bad_pair": ScheduleSpec("bad_pair", _bad_pair)}


def _order_run(rank, world_size, name, slow_rank=None, overlap=None):
    """Chain on ``world_size`` ranks under the registered SPECS[name]; grads against one process,
    the order this rank's pairs ran in, the overlap function's calls."""
    torch.manual_seed(0)
    ref = Chain(n=4)
    model = copy.deepcopy(ref)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    F.mse_loss(ref(x), y).backward()
    spec = SPECS[name]
    calls: list = []

    def fn(pair):
        calls.append(repr(pair.action))
        if overlap == "backward_first":
            pair.backward()
            pair.forward()
        elif overlap == "forward_only":
            pair.forward()
        else:
            pair.forward()
            pair.backward()

    with _registered(spec):
        split = pipeline_split(model, virtual_stages=2 if spec.virtual else 1, placement=spec.placement,
                               cost="params", verbose=False)
        try:
            sched = PipelineSchedule(split, schedule=name, microbatches=2, loss_fn=F.mse_loss,
                                     overlap=fn if overlap else None)
        except ValueError as exc:
            return {"error": str(exc)}
        if slow_rank == rank:  # rank 0's second forward (F0.1) or rank 2's first (F2.0) a second late
            seen = [0]

            def late(mod, args):
                seen[0] += 1
                if seen[0] == (2 if rank == 0 else 1):
                    time.sleep(1.0)
            split.stages[0].module.register_forward_pre_hook(late)
        try:
            losses = sched.step(x, y)
        except PipelineError as exc:
            return {"error": str(exc)}
    ref_grads = dict(ref.named_parameters())
    worst = max(((p.grad - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
                for n, p in split.module.named_parameters())
    return {"grad_err": worst, "loss_err": abs(losses.mean().item() - F.mse_loss(ref(x), y).item()),
            "order": [[repr(h) for h in o] for o in sched.last_pair_order], "calls": calls}


@pytest.mark.parametrize("name,order", [("v_grad", ["B0.0", "F3.1"]), ("v_act", ["F3.1", "B0.0"])])
def test_a_pair_runs_first_the_half_its_peer_sends_for_first(name, order):
    """Both inputs from one peer: the half whose message that peer sends first runs first."""
    res = run_ranks(_order_run, 2, name, timeout=60)
    for r in res:
        assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r
    assert res[0]["order"] == [order] and res[1]["order"] == [], res


@pytest.mark.parametrize("slow_rank,order", [(0, ["B1.0", "F1.1"]), (2, ["F1.1", "B1.0"])])
def test_a_pair_runs_first_the_half_whose_input_arrives_first(slow_rank, order):
    """Inputs from two peers (rank 0's activation, rank 2's gradient): when rank 0 is a second
    late, the backward runs first; when rank 2 is, the forward does."""
    res = run_ranks(_order_run, 3, "loop3", slow_rank, timeout=60)
    for r in res:
        assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r
    assert res[1]["order"] == [order], res


def test_an_overlap_function_runs_each_pair_once_with_the_same_numbers():
    res = run_ranks(_order_run, 2, "v_grad", None, "backward_first", timeout=60)
    for r in res:
        assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r
    assert res[0]["calls"] == ["F3.1&B0.0"] and res[0]["order"] == [["B0.0", "F3.1"]] and res[1]["calls"] == []
    res = run_ranks(_order_run, 2, "v_act", None, "forward_first", timeout=60)
    assert res[0]["calls"] == ["F3.1&B0.0"] and res[0]["order"] == [["F3.1", "B0.0"]], res


def test_a_pair_with_an_input_gradient_half_trains_like_one_process():
    for overlap in (None, "backward_first"):
        res = run_ranks(_order_run, 2, "v_split", None, overlap, timeout=60)
        for r in res:
            assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r
        assert res[0]["order"] == [["F0.1", "I3.0"] if overlap is None else ["I3.0", "F0.1"]], res


def test_the_runtime_refuses_a_pair_whose_halves_wait_on_each_other_on_every_rank():
    res = run_ranks(_order_run, 2, "bad_pair", timeout=60)
    assert all("cannot run its pairs" in r.get("error", "") and "must not wait on each other" in r["error"]
               for r in res), res


def test_an_overlap_function_that_skips_a_half_fails_the_step_on_every_rank():
    res = run_ranks(_order_run, 2, "v_grad", None, "forward_only", timeout=60)
    assert all("without running the backward of pair F3.1&B0.0" in r.get("error", "") for r in res), res


@pytest.mark.parametrize("world_size,opts", [
    (2, {"schedule": "dualpipev", "v": 2, "placement": "v", "overlap": True}),
    (4, {"pp": 2, "dp_shard": 2, "schedule": "dualpipev", "v": 2, "placement": "v", "overlap": True, "m": 6, "batch": 12}),
], ids=["dualpipev-pp2", "dualpipev-pp2xfsdp-m6"])
def test_dualpipev_with_an_overlap_function_matches_one_process(world_size, opts):
    """The harness's overlap function runs each pair's backward first; called once per pair per
    step (two steps), still one reduce-scatter per unit per step and one process's numbers."""
    res = run_ranks(_run, world_size, opts, timeout=120)
    for r in res:
        assert r["pairs"] and r["overlapped"] == 2 * r["pairs"], r
    _check(res)
