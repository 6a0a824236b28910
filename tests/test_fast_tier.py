"""The fast tier's list (tests/conftest.py ``SLOW``) cannot rot: an entry naming a missing file or
test fails the collection; every entry names something that exists. Its budget holds
(tests/_fast_tier.py): the recorded durations fit it, a new test that pushes the tier over fails
a fast-tier session, and a new multi-rank test is found (and so marked slow)."""

from __future__ import annotations

import types

from tests._fast_tier import BUDGET_S, RecordFile, launches_ranks, problems, slowdown
from tests.conftest import SLOW, _matches, _stale


def test_every_slow_entry_exists_and_a_stale_one_is_caught():
    assert SLOW and _stale(SLOW) == []
    bad = ["tests/test_no_such_file.py", "tests/test_planner.py::test_no_such_test"]
    assert _stale(bad + SLOW[:1]) == bad


def test_an_entry_marks_its_file_or_its_test_with_every_parametrization():
    assert _matches("tests/test_a.py::test_b[x-1]", "tests/test_a.py")
    assert _matches("tests/test_a.py::test_b[x-1]", "tests/test_a.py::test_b")
    assert _matches("tests/test_a.py::test_b", "tests/test_a.py::test_b")
    assert not _matches("tests/test_a.py::test_bc", "tests/test_a.py::test_b")
    assert not _matches("tests/test_ab.py::test_b", "tests/test_a.py")


def test_the_recorded_fast_tier_fits_its_budget():
    record = RecordFile.read()
    assert record.budget_s + max(record.collection_s, 10.0) <= BUDGET_S + 0.1
    assert record.total() <= record.budget_s, (
        f"tests/fast_tier.json: the fast tier's tests take {record.total():.0f} quiet s, over its budget of "
        f"{record.budget_s:.0f} s: mark the slowest slow (tests/conftest.py SLOW) and re-record")


def test_a_new_test_that_pushes_the_tier_over_fails_it_and_noise_does_not():
    record = RecordFile(budget_s=10.0, collection_s=5.0, durations={"t::a": 4.0, "t::b": 5.0})
    assert problems(record, {"t::a": 4.0, "t::b": 5.0}, set(), True) == []
    # a known test measured slower (noise under load): its record counts
    assert problems(record, {"t::a": 8.9, "t::b": 5.0}, set(), True) == []
    # a new test of 2 s: 11 s over 10
    (msg,) = problems(record, {"t::a": 4.0, "t::b": 5.0, "t::new": 2.0}, set(), True)
    assert "over its budget of 10 s" in msg and "t::new (2.0 s)" in msg and "SLOW" in msg
    # a known test grown past 2 x its record + 1 s counts at its measured time
    (msg,) = problems(record, {"t::a": 9.5, "t::b": 5.0}, set(), True)
    assert "t::a (9.5 s)" in msg
    # only a session over the whole tier sums; a new multi-rank test fails any fast-tier session
    assert problems(record, {"t::new": 20.0}, set(), False) == []
    (msg,) = problems(record, {"t::c": 0.5}, {"t::c"}, False)
    assert "launch ranks" in msg and "t::c" in msg
    assert problems(record, {"t::a": 0.5}, {"t::a"}, False) == []  # recorded: kept fast


def test_a_new_multi_rank_test_is_found_through_its_module_and_fixtures(tmp_path):
    src = tmp_path / "test_sample.py"
    src.write_text(
        "from tests._dist import run_ranks\n"
        "def _body(rank, world): pass\n"
        "def _flow(n): return run_ranks(_body, n)\n"
        "def check(n): return _flow(n)\n"
        "import pytest\n"
        "@pytest.fixture\n"
        "def runs(): return check(2)\n"
        "def test_direct(): run_ranks(_body, 2)\n"
        "def test_through_helpers(): check(2)\n"
        "def test_through_a_fixture(runs): pass\n"
        "def test_local(): assert sum([1]) == 1\n")

    class Item:  # what launches_ranks reads of a pytest item
        def __init__(self, name, fixtures=()):
            self.path, self.fixturenames = src, list(fixtures)
            self.function = types.SimpleNamespace(__name__=name)

    assert launches_ranks(Item("test_direct")) and launches_ranks(Item("test_through_helpers"))
    assert launches_ranks(Item("test_through_a_fixture", ["runs", "tmp_path"]))
    assert not launches_ranks(Item("test_local", ["tmp_path"]))


def test_slowdown_is_wall_over_cpu_time():
    assert 1.0 <= slowdown(20_000) < 1000
