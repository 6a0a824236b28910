"""How long a user waits for the registered ``interleaved_zb`` lists at pp=32, m=32, v=4 (issue 33,
item 11), through the public API only (``shardwise.composable.build_schedule``, as on every
commit since the schedule registry), so that this file runs unchanged against an older tree.

The build is timed in a fresh rank process (`run_ranks`: forked from the harness's forkserver,
which has imported shardwise and the test modules but never runs a test, so no build has been
cached there; the lists are cached per process, and one in this process may have been made by
another test), without paying a new interpreter's ``import torch``. Wall time of the call alone.
Before the event-driven play (ed46172) it took 29-53 s; at d479197 about 1.5 s of CPU; now about
0.15 s of CPU, under torch's own build of ``ScheduleInterleavedZeroBubble`` (benchmarks/pipeline_zb.py
``--parts build``). The bound is generous for a loaded 2-core machine, where wall time is many
times the CPU time.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

BOUND_S = 10.0


def _build(rank, world_size):
    import time

    from shardwise.composable import build_schedule

    start = time.perf_counter()
    lists = build_schedule("interleaved_zb", 32, 32, 4)
    took = time.perf_counter() - start
    assert len(lists) == 32 and sum(map(len, lists)) == 3 * 32 * 4 * 32, [len(x) for x in lists]
    return took


@pytest.mark.timing
def test_interleaved_zb_at_pp32_m32_v4_builds_within_the_bound():
    took = run_ranks(_build, 1, init_group=False, timeout=600)[0]
    assert took < BOUND_S, f"build_schedule('interleaved_zb', 32, 32, 4) took {took:.1f} s of wall time (bound {BOUND_S} s)"
