"""Tests of the persistent-worker mode of the harness, `tests._dist.run_on_workers`."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankFailure, run_on_workers, shutdown_workers, worker_pool_info

_calls_here = 0  # module state in the workers: survives from call to call only if they are reused


def _count(rank: int, world_size: int) -> dict:
    global _calls_here
    _calls_here += 1
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"pid": os.getpid(), "calls": _calls_here, "sum": t.item(), "rank": dist.get_rank(),
            "group": id(dist.group.WORLD), "threads": torch.get_num_threads(), "RANK": os.environ["RANK"]}


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"boom from worker {rank}")
    dist.barrier()  # the others block here until they are killed


def _hang_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # the others never join
    return rank


def _crash_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(5)
    return rank


def _destroy_group(rank: int, world_size: int) -> bool:
    dist.destroy_process_group()
    return dist.is_initialized()


def _group_after(rank: int, world_size: int) -> tuple[bool, float]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.is_initialized(), t.item()


def test_workers_are_reused_with_their_state_and_group() -> None:
    shutdown_workers()
    first = run_on_workers(_count, 4)
    second = run_on_workers(_count, 4)
    assert [o["sum"] for o in first + second] == [6.0] * 8
    assert [o["rank"] for o in second] == [0, 1, 2, 3] and [o["RANK"] for o in second] == ["0", "1", "2", "3"]
    assert [o["pid"] for o in first] == [o["pid"] for o in second], "same processes"
    assert [o["calls"] for o in second] == [c + 1 for c in (o["calls"] for o in first)], "module state survives"
    assert [o["group"] for o in first] == [o["group"] for o in second], "same default group"
    assert {o["threads"] for o in second} == {1}
    assert len(set(o["pid"] for o in first)) == 4
    info = worker_pool_info()
    assert info["world_size"] == 4 and info["pids"] == [o["pid"] for o in first] and info["calls"] == 2


def test_new_group_keeps_processes_and_rejoins() -> None:
    before = run_on_workers(_count, 2)
    after = run_on_workers(_count, 2, new_group=True)
    assert [o["pid"] for o in before] == [o["pid"] for o in after]
    assert [o["sum"] for o in after] == [1.0, 1.0]
    # a body that destroys the group itself: the next call gets a new one in the same workers
    assert run_on_workers(_destroy_group, 2) == [False, False]
    assert run_on_workers(_group_after, 2) == [(True, 2.0), (True, 2.0)]
    assert worker_pool_info()["pids"] == [o["pid"] for o in before]


def test_failing_call_is_reported_and_the_next_call_gets_fresh_workers() -> None:
    old = run_on_workers(_count, 4)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_workers(_fail_on_rank_1, 4, timeout=30.0)
    message = str(info.value)
    assert "rank 1 of 4 failed" in message and "ValueError: boom from worker 1" in message
    assert "_fail_on_rank_1" in message and list(info.value.errors) == [1]
    assert time.monotonic() - start < 10.0
    assert worker_pool_info() is None, "the failed pool is retired"
    new = run_on_workers(_count, 4)
    assert [o["sum"] for o in new] == [6.0] * 4
    assert not {o["pid"] for o in new} & {o["pid"] for o in old}
    assert {o["calls"] for o in new} == {1}, "fresh processes, no state from before"


def test_hung_call_fails_within_its_timeout_with_stacks() -> None:
    run_on_workers(_count, 2)  # warm: the timeout below measures the call, not the start
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_workers(_hang_on_rank_0, 2, timeout=3.0)
    elapsed = time.monotonic() - start
    assert info.value.hung == [0], str(info.value)
    assert "did not finish within timeout=3.0s" in str(info.value)
    assert "_hang_on_rank_0" in str(info.value) and "in all_reduce" in str(info.value)
    assert "_count" not in str(info.value), "only this call's stack dump is shown"
    assert elapsed < 6.0, f"took {elapsed:.1f}s"
    assert [o["sum"] for o in run_on_workers(_count, 2)] == [1.0, 1.0]


def test_crashed_worker_is_replaced() -> None:
    run_on_workers(_count, 2)
    with pytest.raises(RankFailure, match="rank 1 exited with code 5 without reporting"):
        run_on_workers(_crash_on_rank_1, 2, timeout=30.0)
    assert [o["sum"] for o in run_on_workers(_count, 2)] == [1.0, 1.0]
    # killed while idle: noticed before the next call, which runs on new workers
    pids = worker_pool_info()["pids"]
    os.kill(pids[0], 9)
    time.sleep(0.2)
    out = run_on_workers(_count, 2)
    assert [o["sum"] for o in out] == [1.0, 1.0] and out[0]["pid"] != pids[0]


def test_other_world_size_restarts_the_pool_and_bad_arguments_are_refused() -> None:
    a = run_on_workers(_count, 2)
    b = run_on_workers(_count, 3)
    assert [o["sum"] for o in b] == [3.0] * 3 and worker_pool_info()["world_size"] == 3
    assert not {o["pid"] for o in a} & {o["pid"] for o in b}
    with pytest.raises(ValueError, match="world_size=5"):
        run_on_workers(_count, 5)
    with pytest.raises(TypeError, match="module-level"):
        run_on_workers(lambda rank, world_size: rank, 2)
    shutdown_workers()
    assert worker_pool_info() is None
