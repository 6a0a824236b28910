"""The schedule registry: a schedule defined and registered here, in a test file, runs in
`PipelineSchedule` like a built-in one (gradients equal to one process), also one of split
backwards (I then W); `simulate` knows split backwards."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from shardwise.composable import (SCHEDULES, Action, ActionKind, PipelineSchedule, ScheduleSpec, build_schedule,
                                  pipeline_split, register_schedule, simulate, theoretical_bubble,
                                  unregister_schedule)
from tests._compare import maxerr
from tests._dist import run_ranks


def _reverse_gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Every forward, then the backwards in reverse microbatch order (a toy schedule)."""
    return ([Action(ActionKind.F, rank, i) for i in range(m)]
            + [Action(ActionKind.B, rank, i) for i in reversed(range(m))])


def _split_gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """GPipe with every backward split into I then W."""
    out = [Action(ActionKind.F, rank, i) for i in range(m)]
    for i in range(m):
        out += [Action(ActionKind.I, rank, i), Action(ActionKind.W, rank, i)]
    return out


REVERSE = ScheduleSpec("reverse_gpipe", _reverse_gpipe, bubble=lambda p, m, v: (p - 1) / (m + p - 1))
SPLIT = ScheduleSpec("split_gpipe", _split_gpipe)


@contextmanager
def _registered(spec: ScheduleSpec):
    register_schedule(spec)
    try:
        yield spec
    finally:
        unregister_schedule(spec.name)


class Chain(torch.nn.Module):
    def __init__(self, n: int = 4, width: int = 8):
        super().__init__()
        self.inp = torch.nn.Linear(4, width)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                          for _ in range(n))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.layers:
            h = blk(h)  # a stage boundary carries a block's output as is
        return self.head(h)


def test_registering_a_schedule_adds_it_everywhere():
    with _registered(REVERSE):
        assert "reverse_gpipe" in SCHEDULES and SCHEDULES[-1] == "reverse_gpipe"
        acts = build_schedule("reverse_gpipe", 3, 4)
        assert acts[1] == _reverse_gpipe(1, 3, 4, 1)
        makespan, busy = simulate(acts, 3, 4)
        assert abs((1 - busy[0] / makespan) - theoretical_bubble(3, 4, schedule="reverse_gpipe")) < 1e-9
        with pytest.raises(ValueError, match="already registered"):
            register_schedule(REVERSE)
        with pytest.raises(ValueError, match="runs one stage per rank but 2 virtual stages"):
            build_schedule("reverse_gpipe", 2, 4, 2)
    assert "reverse_gpipe" not in SCHEDULES
    with pytest.raises(ValueError, match="is unknown"):
        build_schedule("reverse_gpipe", 2, 4)


def test_simulate_runs_split_backwards_and_checks_them():
    acts = build_schedule(SPLIT, 3, 4)
    makespan, busy = simulate(acts, 3, 4)
    gp, gbusy = simulate(build_schedule("gpipe", 3, 4), 3, 4)
    assert busy == gbusy, (busy, gbusy)  # same work: I + W take one backward's time
    assert makespan <= gp, (makespan, gp)  # W never delays the previous stage's I
    no_w = [[a for a in r if a.kind is not ActionKind.W] for r in acts]
    with pytest.raises(ValueError, match="exactly once"):
        simulate(no_w, 3, 4)
    w_first = [[Action("W", 0, 0), Action("F", 0, 0), Action("I", 0, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(w_first, 1, 1)
    assert Action("I", 1, 2).kind is ActionKind.I and ActionKind.F == "F"
    with pytest.raises(ValueError, match="action kind 'X' is unknown"):
        Action("X", 0, 0)


def _toy_run(rank, world_size, name):
    torch.manual_seed(0)
    ref = Chain()
    model = copy.deepcopy(ref)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    F.mse_loss(ref(x), y).backward()
    spec = {"reverse_gpipe": REVERSE, "split_gpipe": SPLIT}[name]
    with _registered(spec):  # registered in this process, as every rank of a job would
        split = pipeline_split(model, cost="params", verbose=False)
        try:
            sched = PipelineSchedule(split, schedule=name, microbatches=4, loss_fn=F.mse_loss)
        except ValueError as exc:
            return f"ValueError: {exc}"
        losses = sched.step(x, y)
    worst = 0.0
    ref_grads = dict(ref.named_parameters())
    for n, p in split.module.named_parameters():
        r = ref_grads[n].grad
        worst = maxerr(worst, ((p.grad - r).abs().max() / r.abs().max()).item())
    return {"grad_err": worst, "loss_err": abs(losses.mean().item() - F.mse_loss(ref(x), y).item())}


def test_a_schedule_registered_in_a_test_file_trains_like_one_process():
    for r in run_ranks(_toy_run, 2, "reverse_gpipe", timeout=60):
        assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r


def test_a_split_backward_schedule_registered_in_a_test_file_trains_like_one_process():
    """Before the runtime ran I / W, this schedule was refused on every rank by name."""
    for r in run_ranks(_toy_run, 2, "split_gpipe", timeout=60):
        assert r["grad_err"] <= 1e-6 and r["loss_err"] <= 1e-6, r
