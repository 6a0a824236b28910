"""start_heartbeat: a frozen peer (no broken connection, survivors blocked in a collective) ends
the job within the heartbeat timeout, with the policy's exit status; a rank that stops on purpose
is not taken for dead."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from shardwise.checkpoint import HeartbeatPolicy, start_heartbeat
from tests._dist import RankFailure, run_ranks

POLICY = HeartbeatPolicy(interval_s=0.2, timeout_s=1.5, exit_code=75)


def _frozen_peer(rank, world_size, store_path):
    start_heartbeat(POLICY, store=dist.FileStore(store_path, world_size))
    dist.barrier()
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a vanished host: alive sockets, no beats, no collectives
    dist.barrier()  # without the heartbeat, gloo would wait here for the 600 s collective timeout
    return "not reached"


def test_a_frozen_peer_ends_every_survivor_with_the_exit_status(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_frozen_peer, 3, str(tmp_path / "hb-store"), timeout=30)
    took = time.monotonic() - t0
    errors = info.value.errors
    assert sorted(errors)[:2] == [0, 1], errors
    for r in (0, 1):
        assert "exited with code 75" in errors[r], errors[r]
    assert took < 15, f"detected after {took:.1f} s (timeout {POLICY.timeout_s} s)"


def _finish_early(rank, world_size, store_path):
    dead = []
    hb = start_heartbeat(POLICY, store=dist.FileStore(store_path, world_size), on_dead=dead.append)
    if rank == 0:
        hb.stop()  # done first: its watcher (the last rank) must not take it for dead
    time.sleep(3 * POLICY.timeout_s)
    hb.stop()
    dist.barrier()
    return dead


def test_a_rank_that_stops_on_purpose_is_not_dead(tmp_path):
    assert run_ranks(_finish_early, 2, str(tmp_path / "hb-store"), timeout=30) == [[], []]


def test_policy_refuses_a_timeout_not_above_the_interval():
    with pytest.raises(ValueError, match="interval_s < timeout_s"):
        HeartbeatPolicy(interval_s=2, timeout_s=1)

