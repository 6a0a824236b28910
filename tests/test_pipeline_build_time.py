"""How long a user waits for the registered ``interleaved_zb`` lists at pp=32, m=32, v=4 (issue 33,
item 11), through the public API only (``shardwise.composable.build_schedule``, as on every
commit since the schedule registry), so that this file runs unchanged against an older tree.

The build is timed in a fresh interpreter (the lists are cached per process: a build in this
process may have been made by another test). Wall time of the call alone, not of the import.
Before the event-driven play (ed46172) it took 29-53 s; at d479197 about 1.5 s of CPU; now about
0.15 s of CPU, under torch's own build of ``ScheduleInterleavedZeroBubble`` (benchmarks/pipeline_zb.py
``--parts build``). The bound is generous for a loaded 2-core machine, where wall time is many
times the CPU time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BOUND_S = 10.0

_CHILD = """
import time
from shardwise.composable import build_schedule
start = time.perf_counter()
lists = build_schedule("interleaved_zb", 32, 32, 4)
took = time.perf_counter() - start
assert len(lists) == 32 and sum(map(len, lists)) == 3 * 32 * 4 * 32, [len(x) for x in lists]
print(took)
"""


@pytest.mark.timing
def test_interleaved_zb_at_pp32_m32_v4_builds_within_the_bound():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=dict(os.environ),
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    took = float(done.stdout.split()[-1])
    assert took < BOUND_S, f"build_schedule('interleaved_zb', 32, 32, 4) took {took:.1f} s of wall time (bound {BOUND_S} s)"
