"""The memory model of a pipeline from the schedules' own action lists (pure, no processes).

`activations_in_flight` walks each rank's action list; here it is checked against a walk written
independently (simulated time order instead of list order is not needed: a rank's memory
changes only with its own actions), the closed forms of GPipe / 1F1B / interleaved 1F1B, and
the figures of issue 19 that the old per-schedule formulas got wrong."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable import SCHEDULES, activations_in_flight, build_schedule, get_schedule, plan_memory


def _walk(acts, v):
    """Peak of sum over stages of alive microbatches / v, and the peak per stage (by hand)."""
    alive, peak, per = Counter(), 0.0, Counter()
    for a in acts:
        alive[a.stage] += {"F": 1, "B": -1, "W": -1}.get(a.kind.value, 0)
        per[a.stage] = max(per[a.stage], alive[a.stage])
        peak = max(peak, sum(alive.values()) / v)
    return peak, per


@settings(deadline=None, max_examples=80)
@given(schedule=st.sampled_from(("gpipe", "1f1b", "interleaved_1f1b")), pp=st.integers(1, 8),
       mult=st.integers(1, 4), v=st.integers(2, 4), extra=st.integers(0, 5))
def test_in_flight_is_the_walk_of_the_action_lists(schedule, pp, mult, v, extra):
    if schedule == "interleaved_1f1b":
        m = pp * mult
    else:
        v, m = 1, mult + extra
    got = activations_in_flight(schedule, pp, m, v)
    acts = build_schedule(schedule, pp, m, v)
    for r in range(pp):
        peak, per = _walk(acts[r], v)
        assert abs(got.per_rank[r] - peak) < 1e-9, (r, got.per_rank[r], peak)
        for s in range(r, pp * v, pp):
            assert got.per_stage[s] == per[s], (s, got.per_stage, per)
        if schedule == "gpipe":
            assert got.per_rank[r] == m
        elif schedule == "1f1b":
            assert got.per_rank[r] == min(pp - r, m)
        else:  # warm-up forwards plus the first steady one, each 1/v of the rank's blocks
            warm = min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
            assert abs(got.per_rank[r] - min(warm + 1, m * v) / v) < 1e-9, (r, got.per_rank[r], warm)


def test_the_interleaved_figures_of_issue_19():
    """The old formula gave pp + (pp - 1) / 2 whatever v: 5.5 at pp=4 and 11.5 at pp=8."""
    last = activations_in_flight("interleaved_1f1b", 4, 8, 2).per_rank[3]
    assert last == 5 / 2  # 4 warm-up forwards + 1, half the rank's blocks each
    first = activations_in_flight("interleaved_1f1b", 8, 16, 3).per_rank[0]
    assert abs(first - ((8 - 1) * 2 + 2 * 8 + 1) / 3) < 1e-12 and round(first, 1) == 10.3


def test_stage_weights_and_bad_weights():
    even = activations_in_flight("interleaved_1f1b", 2, 4, 2)
    skew = activations_in_flight("interleaved_1f1b", 2, 4, 2, [0.25, 0.25, 0.75, 0.75])
    assert even.per_stage == skew.per_stage
    assert skew.per_rank != even.per_rank
    with pytest.raises(ValueError, match="3 stage weights for pp \\(2\\) x virtual_stages \\(2\\) = 4"):
        activations_in_flight("interleaved_1f1b", 2, 4, 2, [1, 1, 1])


def _meta_llama(**kw):
    import torch

    from examples.model import Llama, LlamaConfig
    with torch.device("meta"):
        return Llama(LlamaConfig(**kw))


def test_plan_memory_uses_the_walk_for_virtual_stages():
    model = _meta_llama(vocab_size=1000, dim=64, n_layers=8, n_heads=4)
    A = 64 * 2**20
    plan = plan_memory(model, (1, 2), "FULL_SHARD", activation_bytes=A, pp=4, microbatches=8,
                       schedule="interleaved_1f1b", virtual_stages=2)
    alive = activations_in_flight("interleaved_1f1b", 4, 8, 2).per_rank
    assert plan.virtual_stages == 2 and len(plan.bounds) == 9 and plan.in_flight == alive
    for r, st_plan in enumerate(plan.stages):
        blocks = sum(plan.bounds[k + 1] - plan.bounds[k] for k in range(r, 8, 4))
        assert st_plan.activations == int(A * (blocks / 8) * alive[r] / 8), (r, st_plan.activations)
    assert "stage 3 blocks 3..3, 7..7" in str(plan), str(plan)
    with pytest.raises(ValueError, match="multiple of pp"):
        plan_memory(model, (1, 2), "FULL_SHARD", pp=4, microbatches=6, schedule="interleaved_1f1b")


def test_every_registered_schedule_gets_a_memory_model():
    for name in SCHEDULES:
        spec = get_schedule(name)
        v = spec.exact_virtual_stages or (2 if spec.virtual else 1)
        got = activations_in_flight(name, 2, 4, v)
        assert len(got.per_rank) == 2 and all(0 < x <= 4 for x in got.per_rank), (name, got)


def _walk_kept(acts, kept):
    """Peak units with ``kept`` more per microbatch between its I and its W (by hand, v = 1)."""
    level = peak = 0.0
    for a in acts:
        k = kept if a.stage > 0 else 0.0  # stage 0's I keeps nothing: its W is the whole backward
        level += {"F": 1.0, "B": -1.0, "I": k, "W": -1.0 - k}[a.kind.value]
        peak = max(peak, level)
    return peak


@settings(deadline=None, max_examples=40)
@given(schedule=st.sampled_from(("1f1b", "zb_h1")), pp=st.integers(1, 6), m=st.integers(1, 12),
       kept=st.floats(0, 2))
def test_kept_gradients_count_between_i_and_w(schedule, pp, m, kept):
    got = activations_in_flight(schedule, pp, m, kept_grads=kept).per_rank
    base = activations_in_flight(schedule, pp, m).per_rank
    for r, acts in enumerate(build_schedule(schedule, pp, m)):
        assert abs(got[r] - _walk_kept(acts, kept)) < 1e-9, (r, got[r])
        if schedule == "1f1b":
            assert got[r] == base[r]  # no I: nothing kept
        elif r == 0:  # zb_h1's first stage keeps nothing from I to W
            assert got[r] == base[r]
        else:  # zb_h1: rank r holds r + 1 microbatches between I and W at its peak (m >= r + 1)
            assert abs(got[r] - base[r] - min(r + 1, m) * kept) < 1e-9, (r, got[r], base[r])


def test_kept_gradients_must_be_a_ratio():
    with pytest.raises(ValueError, match="kept_grads=-0.5"):
        activations_in_flight("zb_h1", 2, 4, kept_grads=-0.5)
