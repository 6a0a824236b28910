"""Building the list-scheduled zero-bubble lists: the same lists as before, fast (issue 33, item 11).

`interleaved_zb` took 29-53 s at pp=32, m=32, v=4 and did not finish in 600 s at pp=64, m=128:
every instant of the list scheduler re-examined every rank, building `Action` objects, and
`simulate` swept all ranks once per step of progress. The play and the simulator are now
event-driven ([Note: the play's events] in ``_schedule_greedy.py``, `_order` in
``_simulate.py``). The lists must not change: the digests below were recorded with the code
before that change (commit 4ac1138), for every list-scheduled size tried there.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from shardwise.composable import build_schedule, simulate, tune_schedule
from shardwise.composable._pipeline._schedules._schedule_greedy import greedy_lists, greedy_plays
from shardwise.composable._pipeline._schedules._schedule_zbv import _model, izb_cap
from shardwise.composable._pipeline._schedules._simulate import makespans


def _digest(lists) -> str:
    return hashlib.sha256(repr([list(map(repr, acts)) for acts in lists]).encode()).hexdigest()[:16]


BEFORE = {  # (schedule, pp, m, v) -> digest of the lists built before the change
    ("interleaved_zb", 2, 4, 2): "070903c66872fb29",
    ("interleaved_zb", 2, 6, 3): "efc481b4d0455507",
    ("interleaved_zb", 3, 6, 2): "f9cf413616557cd5",
    ("interleaved_zb", 4, 8, 2): "db25990f3b770c85",
    ("interleaved_zb", 4, 4, 4): "7c64a70a34ea2aa6",
    ("interleaved_zb", 4, 12, 3): "cfff0dc14f20c44a",
    ("interleaved_zb", 8, 16, 2): "62ae7a185b3f5270",
    ("interleaved_zb", 8, 8, 4): "8b339497c791e873",
    ("interleaved_zb", 6, 12, 3): "989091ecfc5bee98",
    ("interleaved_zb", 16, 16, 4): "e1be57ee13b0cfc2",
    ("zbv", 2, 4, 2): "fa955cb86d3724b9",
    ("zbv", 3, 5, 2): "81370e6407abfae1",
    ("zbv", 4, 8, 2): "22f7cfd50b8e79fa",
    ("zbv", 5, 3, 2): "7ef7294f2c524ea4",
    ("zbv", 8, 16, 2): "f3bdfed68af98a5d",
    ("zbv", 16, 32, 2): "ab21a5a12b4c9bb4",
}


@pytest.mark.parametrize("key", sorted(BEFORE), ids=lambda k: "-".join(map(str, k)))
def test_registered_lists_are_the_ones_built_before(key):
    name, pp, m, v = key
    lists = build_schedule(name, pp, m, v)
    assert _digest(lists) == BEFORE[key], key
    simulate(lists, pp * v, m)  # and they are complete and deadlock-free


def test_greedy_plays_with_messages_and_stalls_are_the_ones_before():
    costs = _model(8, 1.15, 0.85, 1.2)
    assert _digest(greedy_lists(4, 8, 2, "loop", izb_cap(4, 8, 2), costs=costs, prefer="IFW",
                                reserve=True)) == "3899f96022386f31"
    assert _digest(greedy_lists(3, 9, 3, "loop", izb_cap(3, 9, 3), costs=_model(9, 1.15, 0.85, 1.2),
                                comm_time=0.05, prefer="FIW", reserve=True)) == "dcbb12828965fab4"
    with pytest.raises(ValueError, match="greedy schedule stuck at pp=4, m=8, v=2"):
        greedy_lists(4, 8, 2, "loop", izb_cap(4, 8, 2), costs=costs, comm_time=0.3, prefer="IWF")
    # greedy_plays: the same plays as greedy_lists without and with reserve, stalled ones left out
    for comm in (0.0, 0.3):
        want = []
        for reserve in (False, True):
            try:
                want.append(greedy_lists(4, 8, 2, "loop", izb_cap(4, 8, 2), costs=costs, comm_time=comm,
                                         prefer="IWF", reserve=reserve))
            except ValueError:
                pass
        got = greedy_plays(4, 8, 2, "loop", izb_cap(4, 8, 2), costs=costs, comm_time=comm, prefer="IWF")
        assert got == want, comm
    tuned = tune_schedule("interleaved_zb", 4, 8, 2, _model(8, 1.1, 0.9, 1.3), comm_time=0.05, max_trials=50)
    assert _digest(tuned.actions(4, 8, 2)) == "db25990f3b770c85"


def test_simulate_gives_the_figures_it_gave_before():
    """The event-driven sweep starts each action when the old all-ranks sweep did (bit for bit)."""
    izb = build_schedule("interleaved_zb", 4, 8, 2)
    skewed = _model(8, 0.85, 1.15, 1.2)
    assert simulate(izb, 8, 8) == (52.0, [48.0] * 4)
    assert simulate(izb, 8, 8, costs=skewed, comm_time=0.1) == (
        56.82000000000003, [48.0, 47.99999999999999, 48.0, 52.80000000000001])
    zbv = build_schedule("zbv", 4, 8, 2)
    assert simulate(zbv, 8, 8, costs=skewed, comm_time=0.1) == (53.60000000000001, [52.80000000000001, 48.0, 48.0, 48.0])
    dual = build_schedule("dualpipev", 4, 8, 2)
    assert simulate(dual, 8, 8, costs=skewed, comm_time=0.1) == (51.900000000000006, [50.8, 48.0, 48.0, 48.0])
    assert simulate(dual, 8, 8, overlap=0.5) == (48.5, [45.5, 45.0, 44.5, 44.0])
    assert makespans(izb, 8, 8, [None, skewed], comm_time=0.1) == [
        simulate(izb, 8, 8, comm_time=0.1)[0], simulate(izb, 8, 8, costs=skewed, comm_time=0.1)[0]]
    assert makespans(dual, 8, 8, [None, skewed]) == [simulate(dual, 8, 8)[0], simulate(dual, 8, 8, costs=skewed)[0]]


@pytest.mark.timing
def test_interleaved_zb_builds_in_seconds_at_pp32():
    """Before: 29-53 s (torch: 0.5 s); at d479197 about 1.5-3 s, now about 0.15-0.3 s on a loaded
    2-core CPU (the public, wall-time bound: tests/test_pipeline_build_time.py). The bound is
    on this process's CPU time (other jobs on a shared machine stretch the wall time many times
    over) and generous. The lists are the ones built before."""
    from shardwise.composable._pipeline._schedules._schedule_zbv import _izb_lists

    _izb_lists.cache_clear()
    start = time.process_time()
    lists = build_schedule("interleaved_zb", 32, 32, 4)
    took = time.process_time() - start
    assert _digest(lists) == "bfcd83366c53a964"
    assert took < 15.0, f"interleaved_zb at pp=32, m=32, v=4 took {took:.1f} s of CPU"
