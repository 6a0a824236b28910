"""The fast tier's list (tests/conftest.py ``SLOW``) cannot rot: an entry naming a missing file or
test fails the collection; every entry names something that exists."""

from __future__ import annotations

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
