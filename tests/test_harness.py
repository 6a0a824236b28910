"""Tests of the multi-rank harness `tests._dist.run_ranks` itself."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankFailure, run_ranks

# Bodies: module-level so rank processes can import them by name.


def _all_reduce_body(rank: int, world_size: int, scale: float) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "sum": t.item() * scale,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "X")},
    }


def _fail_on_rank_2(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()  # the others block here until they are killed


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def _collective_only_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # the others never join...
    else:
        time.sleep(3600)  # ...and stay alive (exiting would break rank 0's connections)
    return rank


def _crash_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def _abort_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        _native_crash_here()
    dist.barrier()
    return rank


def _native_crash_here() -> None:
    os.abort()  # what glibc does on heap corruption ("malloc(): ..."): SIGABRT, no Python exception


def _unpicklable_result(rank: int, world_size: int):
    return lambda: rank


def _no_group(rank: int, world_size: int) -> bool:
    return dist.is_initialized()


def _noop(rank: int, world_size: int) -> int:
    return rank


def test_all_reduce_and_return_values() -> None:
    out = run_ranks(_all_reduce_body, 4, 2.0, env={"X": "y"})
    assert [o["sum"] for o in out] == [12.0] * 4
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert {o["world_size"] for o in out} == {4}
    assert {o["backend"] for o in out} == {"gloo"}
    assert {o["threads"] for o in out} == {1}
    assert [o["env"]["RANK"] for o in out] == ["0", "1", "2", "3"]
    assert {o["env"]["X"] for o in out} == {"y"}
    assert {o["env"]["LOCAL_WORLD_SIZE"] for o in out} == {"4"}


def test_env_simulates_hosts() -> None:
    out = run_ranks(_all_reduce_body, 4, 1.0, env={"LOCAL_WORLD_SIZE": 2, "X": None})
    assert [o["env"]["LOCAL_RANK"] for o in out] == ["0", "1", "0", "1"]
    assert [o["env"]["GROUP_RANK"] for o in out] == ["0", "0", "1", "1"]
    assert {o["env"]["X"] for o in out} == {None}


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_world_sizes(world_size: int) -> None:
    out = run_ranks(_all_reduce_body, world_size, 1.0)
    expected = world_size * (world_size - 1) / 2
    assert [o["sum"] for o in out] == [expected] * world_size


def test_failing_rank_reports_its_traceback_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_rank_2, 4, timeout=30.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 2 of 4 failed" in message
    assert "ValueError: boom from rank 2" in message
    assert "Traceback (most recent call last)" in message
    assert "_fail_on_rank_2" in message
    assert list(info.value.errors) == [2]  # the others stay blocked in barrier
    assert "ranks [0, 1, 3] were still running and were killed" in message
    # structural: well under the 30 s timeout, i.e. the failure ended the run, not the timeout
    # (generous for 2 shared cores)
    assert elapsed < 20.0, f"others were not killed promptly: {elapsed:.1f}s"


@pytest.mark.parametrize("body", [_sleep_on_rank_1, _collective_only_on_rank_0])
def test_hung_rank_fails_within_timeout(body) -> None:
    timeout = 3.0  # long enough for 4 ranks to reach the body on a loaded machine
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(body, 4, timeout=timeout)
    elapsed = time.monotonic() - start
    message = str(info.value)
    hung = [1] if body is _sleep_on_rank_1 else [0, 1, 2, 3]
    assert info.value.hung == hung
    assert f"ranks {hung} of 4 did not finish within timeout=3.0s" in message
    assert body.__name__ in message  # from the ranks' stack dumps
    if body is _collective_only_on_rank_0:
        assert "in all_reduce" in message
    # the run ends at the timeout plus stack dumps and kills, not never (generous: shared cores)
    assert elapsed < timeout + 15.0, f"took {elapsed:.1f}s"


def test_crashed_rank_is_reported() -> None:
    with pytest.raises(RankFailure, match="rank 1 exited with code 3 without reporting"):
        run_ranks(_crash_on_rank_1, 2, timeout=30.0)


def test_native_crash_reports_the_python_stack() -> None:
    """A rank killed by a signal (a native crash) reports where Python was: the function names
    of its stack, from faulthandler."""
    with pytest.raises(RankFailure, match=r"(?s)signal SIGABRT.*Python stacks at the crash.*_native_crash_here"):
        run_ranks(_abort_on_rank_1, 2, timeout=30.0)


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(RankFailure, match="cannot be sent back"):
        run_ranks(_unpicklable_result, 2)


def test_init_group_false() -> None:
    assert run_ranks(_no_group, 2, init_group=False) == [False, False]


def test_rejects_local_function_and_bad_world_size() -> None:
    def local(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local, 2)
    with pytest.raises(ValueError, match="world_size=9"):
        run_ranks(_noop, 9)


def test_overhead_of_four_ranks() -> None:
    run_ranks(_noop, 4)  # make sure the forkserver is warm
    times = []
    for _ in range(5):
        start = time.monotonic()
        assert run_ranks(_noop, 4) == [0, 1, 2, 3]
        times.append(time.monotonic() - start)
    print(f"\nrun_ranks overhead, 4 ranks (min/median/max of 5): "
          f"{min(times):.3f}/{sorted(times)[2]:.3f}/{max(times):.3f} s")
    assert sorted(times)[2] < 15.0, "run_ranks overhead grew by an order of magnitude"


def _return_tensor(rank: int, world_size: int):
    return {"t": torch.full((3,), float(rank))}


def test_tensors_come_back_by_value() -> None:
    out = run_ranks(_return_tensor, 2)
    assert [o["t"].tolist() for o in out] == [[0.0] * 3, [1.0] * 3]


def _sleep_for(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def test_a_run_near_its_timeout_is_warned_about() -> None:
    """A run that takes more than half its timeout passes with a `NearTimeoutWarning` naming
    the body, so a CI log shows which tests a loaded machine may time out; a quick one does not."""
    from tests._dist import NearTimeoutWarning

    with pytest.warns(NearTimeoutWarning, match=r"_sleep_for on 2 ranks took \d+ s of its timeout=11 s"):
        assert run_ranks(_sleep_for, 2, 6.0, timeout=11.0) == [0, 1]  # 5 s to spare for a loaded machine
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", NearTimeoutWarning)
        assert run_ranks(_sleep_for, 2, 0.0, timeout=60.0) == [0, 1]
