"""The fast tier's budget (``pytest -m "not slow"``: at most `BUDGET_S` of pytest on a quiet
2-core machine; docs/testing.md, "The fast tier"), kept by the suite itself.

[Note: the fast tier's budget on a loaded machine]
Wall-clock time on a shared machine says little (the same tier took 90 s quiet and several
minutes under load), so the budget is kept on durations in *quiet seconds*: `RECORD`
(tests/fast_tier.json) holds each fast test's duration (setup + call + teardown), measured by a
fast-tier run with ``--fast-tier-record`` and divided by the machine's slowdown at that time.
The slowdown is measured, not stored (`slowdown`): a fixed single-thread loop's wall-clock time
over its CPU time, which is what a runnable process's share of the cores is; taken before the
first test and every `EVERY` tests, each test's duration divided by the latest. A fast-tier
session (``-m "not slow"`` over the whole of tests/) then sums, over the tests that ran, the
recorded duration of a known test, or the measured one (in quiet seconds) of a test that is new
or has grown past twice its record plus a second; over `RecordFile.budget_s` (the budget less
the collection's time) the session fails, naming the new and grown tests. So a new test that
pushes the tier over fails it, on a loaded machine as on a quiet one, while noise in the known
tests cannot. The sum of the record alone is checked by tests/test_fast_tier.py in every run.

New multi-rank tests are slow unless marked fast: a test that launches ranks (`launches_ranks`:
its function or a fixture it takes calls ``run_ranks`` / ``run_on_workers``, directly or through
functions of its module) and is neither in the record nor marked ``@pytest.mark.fast`` is marked
``slow`` at collection. A fast-tier session also counts launches at run time (tests/_dist.py
``launches()``) and fails on an unrecorded, unmarked test that launched ranks anyway (through a
helper of another module).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "fast_tier.json"
BUDGET_S = 120.0  # the fast tier's pytest time on a quiet 2-core machine, collection included
LAUNCHERS = frozenset({"run_ranks", "run_on_workers"})
GROWN = (2.0, 1.0)  # a known test counts at its measured duration past 2 x its record + 1 s


@dataclasses.dataclass(frozen=True)
class RecordFile:
    """tests/fast_tier.json: ``budget_s`` for the tests' summed durations (the collection's time
    taken off `BUDGET_S`), the collection's quiet seconds, each fast test's quiet seconds."""

    budget_s: float
    collection_s: float
    durations: dict[str, float]

    @classmethod
    def read(cls, path: pathlib.Path = RECORD) -> RecordFile:
        raw = json.loads(path.read_text())
        return cls(raw["budget_s"], raw["collection_s"], raw["durations"])

    def write(self, path: pathlib.Path = RECORD) -> None:
        raw = dataclasses.asdict(self)
        raw["durations"] = {k: round(v, 3) for k, v in sorted(self.durations.items())}
        path.write_text(json.dumps(raw, indent=1) + "\n")

    def total(self) -> float:
        return sum(self.durations.values())


EVERY = 20  # tests between two measurements of the slowdown


def slowdown(n: int = 200_000) -> float:
    """How many times slower than on an idle machine a process runs now: a fixed single-thread
    loop's wall-clock time over its CPU time (at least 1)."""
    wall, cpu = time.perf_counter(), time.process_time()
    x = 0
    for i in range(n):
        x += i * i % 7
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return max(1.0, wall / max(cpu, 1e-6))


def _calls(node: ast.AST) -> set[str]:
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
        elif isinstance(sub, ast.Name):  # a function passed along (functools.partial(check, ...))
            out.add(sub.id)
    return out


_MODULE_LAUNCHERS: dict[str, set[str]] = {}


def _launching_functions(path: pathlib.Path) -> set[str]:
    """Module-level functions (and methods, by name) of ``path`` that launch ranks, directly or
    through other functions of the module."""
    key = str(path)
    if key not in _MODULE_LAUNCHERS:
        tree = ast.parse(path.read_text(), key)
        funcs = {n.name: _calls(n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        launching = {name for name, calls in funcs.items() if calls & LAUNCHERS}
        grew = True
        while grew:
            new = {name for name, calls in funcs.items() if name not in launching and calls & launching}
            launching |= new
            grew = bool(new)
        _MODULE_LAUNCHERS[key] = launching
    return _MODULE_LAUNCHERS[key]


def launches_ranks(item: pytest.Item) -> bool:
    """Whether ``item``'s test function, or a fixture of its module it takes, launches ranks."""
    path = getattr(item, "path", None)
    func = getattr(item, "function", None)
    if path is None or func is None or not str(path).endswith(".py"):
        return False
    launching = _launching_functions(pathlib.Path(path))
    return func.__name__ in launching or bool(set(getattr(item, "fixturenames", ())) & launching)


def is_fast_tier(config: pytest.Config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "not slow"


def whole_tier(config: pytest.Config) -> bool:
    """A fast-tier session over all of tests/ (not a file or a ``-k`` subset)."""
    args = [pathlib.Path(a).resolve() for a in config.args]
    return is_fast_tier(config) and not config.getoption("keyword", "") and args in (
        [ROOT / "tests"], [ROOT])


def problems(record: RecordFile, durations: dict[str, float], launched: set[str], whole: bool) -> list[str]:
    """What a fast-tier session broke: ``durations`` the measured quiet seconds by test (wall
    time over the slowdown), ``launched`` the tests that launched ranks and are not marked fast,
    ``whole`` whether the session ran the whole tier (only then is the sum checked). Empty when
    within budget."""
    known, counted, new = record.durations, 0.0, {}
    for nodeid, quiet in durations.items():
        rec = known.get(nodeid)
        if rec is not None and quiet <= GROWN[0] * rec + GROWN[1]:
            counted += rec
        else:
            counted += quiet
            new[nodeid] = quiet
    out = []
    unmarked = sorted(launched - set(known))
    if unmarked:
        out.append(f"new tests that launch ranks run in the fast tier: {unmarked[:5]}: mark them slow "
                   "(tests/conftest.py SLOW) or, if truly cheap, @pytest.mark.fast")
    if whole and counted > record.budget_s:
        worst = sorted(new.items(), key=lambda kv: -kv[1])[:8]
        listed = ", ".join(f"{n} ({s:.1f} s)" for n, s in worst) or "none"
        out.append(f"the fast tier's tests take {counted:.0f} quiet s, over its budget of {record.budget_s:.0f} s "
                   f"(durations divided by the machine's slowdown); new or grown tests: {listed}. Mark the slowest slow "
                   "(tests/conftest.py SLOW), or if the tier got faster re-record: "
                   "python -m pytest -q -m 'not slow' tests --fast-tier-record")
    return out


class BudgetPlugin:
    """Measures a fast-tier session and checks (or, with ``--fast-tier-record``, writes) the record."""

    def __init__(self, config: pytest.Config, record: RecordFile | None) -> None:
        self.config, self.record = config, record
        self.durations: dict[str, float] = {}  # quiet seconds
        self.launched: set[str] = set()
        self.factor, self.factors, self.seen = slowdown(), [], 0
        self.factors.append(self.factor)
        self.t_start = time.perf_counter()
        self.t_collected: float | None = None
        self.failure: str | None = None

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.t_collected = time.perf_counter()
        self.collection_s = (self.t_collected - self.t_start) / ((self.factor + slowdown()) / 2)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        from tests._dist import launches

        if self.seen % EVERY == 0:
            self.factor = slowdown()
            self.factors.append(self.factor)
        self.seen += 1
        before = launches()
        yield
        if launches() > before:
            self.launched.add(item.nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration / self.factor

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        if self.config.getoption("fast_tier_record"):
            self._write()
            return
        if self.record is None:
            return
        unmarked = {n for n in self.launched if not self._marked_fast(session, n)}
        found = problems(self.record, self.durations, unmarked, whole_tier(self.config))
        if found:
            self.failure = "\n".join(found)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _marked_fast(self, session: pytest.Session, nodeid: str) -> bool:
        return any(i.nodeid == nodeid and i.get_closest_marker("fast") for i in session.items)

    def _write(self) -> None:
        if not whole_tier(self.config):
            raise pytest.UsageError("--fast-tier-record needs the whole fast tier: pytest -m 'not slow' tests")
        collection = getattr(self, "collection_s", 0.0)
        budget = round(BUDGET_S - max(collection, 10.0), 1)
        RecordFile(budget, round(collection, 1), self.durations).write()
        self.failure = None

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        if self.failure:
            terminalreporter.section("fast tier budget", sep="=", red=True, bold=True)
            terminalreporter.write_line(self.failure)
        elif config.getoption("fast_tier_record"):
            terminalreporter.write_line(f"fast tier recorded in {RECORD.relative_to(ROOT)}")
