"""`PipelineSchedule.last_timing` and `last_action_times`: what a step reports of its own time
(the inputs of `retune` and of the measured bubble in benchmarks/pipeline_zb.py)."""

from __future__ import annotations

import torch

import shardwise.composable as sw
from tests._dist import run_ranks


def _timing(rank, world_size, schedule):
    from examples.model import Llama
    from shardwise.mesh import init_mesh, pipeline_mesh
    from tests.test_pipeline import CFG, _batch, _ce

    inputs, targets = _batch(8)
    model = Llama(CFG, generator=torch.Generator().manual_seed(0))
    spec = sw.get_schedule(schedule)
    v = spec.exact_virtual_stages or 1
    mesh = init_mesh(pp=world_size, device_type="cpu")
    split = sw.pipeline_split(model, pipeline_mesh(mesh), virtual_stages=v, placement=spec.placement,
                              cost="params", verbose=False)
    sched = sw.PipelineSchedule(split, schedule=schedule, microbatches=4, loss_fn=_ce)
    sched.step(inputs, targets)
    return sched.last_timing, sched.last_action_times, [st.index for st in split.stages]


def test_a_step_reports_compute_sends_and_its_actions():
    """``send_s`` (issuing sends between actions) is busy time apart from ``compute_s``, ``wait_s``
    (for messages, and for the other ranks at the step's end) the idle time; all fit in the step;
    every (kind, stage) of this rank's actions has a mean wall and CPU time."""
    for rank, (timing, actions, stages) in enumerate(run_ranks(_timing, 2, "zbv", timeout=120)):
        assert set(timing) == {"compute_s", "compute_cpu_s", "send_s", "wait_s", "step_s"}, timing
        assert timing["send_s"] > 0 and timing["compute_s"] > 0 and timing["wait_s"] > 0, timing
        assert timing["compute_s"] + timing["send_s"] + timing["wait_s"] <= timing["step_s"], timing
        assert set(actions) == {(k, s) for s in stages for k in "FIW"}, (rank, sorted(actions))
        assert all(wall >= 0 and cpu >= 0 for wall, cpu in actions.values()), actions


def test_one_rank_sends_nothing():
    ((timing, actions, stages),) = run_ranks(_timing, 1, "1f1b", timeout=120)
    assert timing["send_s"] == timing["wait_s"] == 0.0 and set(actions) == {("F", 0), ("B", 0)}, (timing, actions)
