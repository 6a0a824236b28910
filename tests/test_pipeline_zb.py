"""The ZB-H1 schedule's action lists (issue 23, first step): complete and deadlock-free for any
``pp`` and ``m``; with forward, input-gradient and weight-gradient times equal, its bubble is
``(p - 1) / (3 m + p - 1)`` (m >= p), a third of 1F1B's bubble time; its peak activations, from
the memory walk, never exceed 1F1B's worst rank; and the runtime, which runs F and B only so far,
refuses it by name on every rank."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable import (ActionKind, PipelineSchedule, activations_in_flight, build_schedule, pipeline_split,
                                  register_schedule, simulate, theoretical_bubble, unregister_schedule)
from shardwise.composable._pipeline._schedule_zb_h1 import ZB_H1
from tests._dist import run_ranks
from tests.test_pipeline_agreement import Chain


@contextmanager
def _zb():
    register_schedule(ZB_H1)
    try:
        yield
    finally:
        unregister_schedule(ZB_H1.name)


@settings(deadline=None, max_examples=80)
@given(pp=st.integers(1, 8), m=st.integers(1, 24))
def test_zb_h1_is_complete_deadlock_free_and_a_third_of_1f1b(pp, m):
    with _zb():
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
    with _zb():
        makespan, busy = simulate(build_schedule("zb_h1", 4, 8), 4, 8)
        assert activations_in_flight("zb_h1", 4, 8).per_rank == (4, 4, 4, 4)
    assert (makespan, 1 - busy[0] / makespan) == (3 * 8 + 4 - 1, pytest.approx(3 / 27))  # 3m + p - 1


def _refused(rank, world_size):
    with _zb():
        split = pipeline_split(Chain(), cost="params", verbose=False)
        try:
            PipelineSchedule(split, schedule="zb_h1", microbatches=4, loss_fn=F.mse_loss)
        except ValueError as exc:
            return str(exc)
    return "built"


def test_the_runtime_refuses_zb_h1_until_it_runs_split_backwards():
    got = run_ranks(_refused, 2, timeout=60)
    assert len(set(got)) == 1 and "schedule 'zb_h1' uses action kinds ['I', 'W']" in got[0], got
