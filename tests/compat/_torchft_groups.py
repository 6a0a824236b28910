"""Replica groups under torchft on one machine, for tests and benchmarks: a lighthouse on
127.0.0.1, groups of real processes (`tests/compat/_torchft_rank.py`), kills and restarts.

Every rank of a group is in one process group (the first rank leads it), so a group is killed
by one signal; `Cluster` is a context manager whose exit kills every group it started and the
lighthouse, whatever happened. Every wait is bounded and a failed wait raises with the tail of
every rank's log and its step records.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str | None:
    """The ``torchft_lighthouse`` of torchft's wheel, beside this interpreter or on ``PATH``."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    return str(here) if here.exists() else shutil.which("torchft_lighthouse")


def start_lighthouse(workdir: Path, *, heartbeat_ms: int = 1000, join_ms: int = 3000,
                     min_replicas: int = 1) -> tuple[subprocess.Popen, str]:
    """``torchft_lighthouse`` on a free port of 127.0.0.1 (log: ``workdir/lighthouse.log``);
    returns the process (stop it with `stop`) and its URL, once it accepts connections."""
    binary = lighthouse_binary()
    assert binary, "torchft_lighthouse is not installed (torchft's wheel has it)"
    port = free_port()
    with open(workdir / "lighthouse.log", "w") as log:
        proc = subprocess.Popen(
            [binary, "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}",
             "--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(heartbeat_ms),
             "--quorum_tick_ms", "50"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise AssertionError("the lighthouse did not start: " + (workdir / "lighthouse.log").read_text()[-2000:])
        time.sleep(0.05)


def stop(proc: subprocess.Popen | None) -> None:
    """Kill ``proc`` and the process group it leads, and reap it."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait(timeout=30)


@dataclass
class Group:
    """One replica group's processes (rank 0 leads their process group)."""
    gid: int
    procs: list[subprocess.Popen]
    logs: list[Path]
    records: list[Path]

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.procs[0].pid, sig)
        except ProcessLookupError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


@dataclass
class Cluster:
    """A lighthouse and the replica groups of one scenario, in ``workdir``."""
    workdir: Path
    impl: str
    ranks: int = 2
    heartbeat_ms: int = 1000
    join_ms: int = 3000
    rank_timeout: float = 30.0
    groups: dict[int, Group] = field(default_factory=dict)
    lighthouse: subprocess.Popen | None = None
    url: str = ""
    starts: int = 0

    def __enter__(self) -> "Cluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lighthouse, self.url = start_lighthouse(self.workdir, heartbeat_ms=self.heartbeat_ms,
                                                     join_ms=self.join_ms)
        return self

    def __exit__(self, *exc) -> None:
        for g in self.groups.values():
            g.kill()
        stop(self.lighthouse)

    def start(self, gid: int, *args: str, ranks: int | None = None) -> Group:
        """Start replica group ``gid`` (all its ranks); its step records go on after a restart."""
        ranks = ranks or self.ranks
        port = free_port()
        procs, logs, records = [], [], []
        self.starts += 1
        for r in range(ranks):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                       WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks),
                       TORCHFT_LIGHTHOUSE=self.url, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
            log = self.workdir / f"g{gid}r{r}.log"
            rec = self.workdir / f"g{gid}r{r}.jsonl"
            out = open(log, "a")
            out.write(f"--- start {self.starts} ---\n")
            out.flush()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.compat._torchft_rank", "--impl", self.impl,
                 "--group", str(gid), "--dir", str(self.workdir), "--log", str(rec),
                 "--timeout", str(self.rank_timeout), *args],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                process_group=0 if r == 0 else procs[0].pid))
            out.close()
            logs.append(log)
            records.append(rec)
        self.groups[gid] = Group(gid, procs, logs, records)
        return self.groups[gid]

    def go(self, timeout: float) -> None:
        """Once every rank of every group started with ``--wait-go`` heartbeats, let them step."""
        want = [f"ready.g{g}r{r}" for g, grp in self.groups.items() for r in range(len(grp.procs))]
        self.wait("every rank to reach the lighthouse",
                  lambda: all((self.workdir / n).exists() for n in want), timeout)
        (self.workdir / "go").touch()

    def records(self, gid: int, rank: int = 0) -> list[dict]:
        path = self.workdir / f"g{gid}r{rank}.jsonl"
        if not path.exists():
            return []
        return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.endswith("}"))
                if "step" in r]

    def final(self, gid: int, rank: int = 0) -> dict:
        """The last record of a rank run with ``--measure-bytes``: ``sent_bytes``, ``state_bytes``."""
        lines = (self.workdir / f"g{gid}r{rank}.jsonl").read_text().splitlines()
        return json.loads(lines[-1])

    def step(self, gid: int, rank: int = 0) -> int:
        recs = self.records(gid, rank)
        return recs[-1]["step"] if recs else -1

    def stop_at(self, step: int) -> None:
        tmp = self.workdir / "stop.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.workdir / "stop")

    def report(self) -> str:
        out = []
        for path in sorted(self.workdir.glob("*.log")):
            out.append(f"==== {path.name} (tail)\n{path.read_text(errors='replace')[-3000:]}")
        for path in sorted(self.workdir.glob("*.jsonl")):
            lines = path.read_text().splitlines()
            out.append(f"==== {path.name}: {len(lines)} records, last: {lines[-3:]}")
        return "\n".join(out)

    def wait(self, what: str, pred, timeout: float) -> None:
        """Poll ``pred()`` until true; fail after ``timeout`` s with every group's logs."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.report()}")
            time.sleep(0.1)

    def wait_exit(self, gid: int, timeout: float) -> list[int]:
        g = self.groups[gid]
        self.wait(f"group {gid} to exit", lambda: not g.alive(), timeout)
        return [p.returncode for p in g.procs]


def kill_and_heal(c: Cluster, *, die_at: int = 3, down_steps: int = 3, pace: float = 0.1,
                  extra: tuple[str, ...] = (), wait_s: float = 240.0) -> dict[str, int]:
    """Groups 0 and 1 start together; group 1's rank 1 leaves by ``os._exit`` at step ``die_at``
    (the launcher then kills what is left of the group); group 0 steps alone for ``down_steps``;
    group 1 restarts and heals; after one step back the whole group is killed by ``SIGKILL``;
    group 0 steps alone again, group 1 restarts and heals again, and both stop two steps later.
    Returns the survivor's step at each event (the test checks the records)."""
    common = ("--pace", str(pace), *extra)
    c.start(0, "--wait-go", *common)
    c.start(1, "--wait-go", "--die-at", str(die_at), *common)
    c.go(wait_s)
    g1 = c.groups[1]
    c.wait("group 1 rank 1 to exit at its step", lambda: g1.procs[1].poll() is not None, wait_s)
    events = {"exit": c.step(0)}
    g1.kill()
    c.wait("group 0 to step alone", lambda: c.step(0) >= events["exit"] + down_steps, wait_s)
    events["restart1"] = c.step(0)
    c.start(1, *common)
    c.wait("group 1 to heal and commit", lambda: c.step(1) > events["restart1"], wait_s)
    events["back1"] = c.step(1)
    c.wait("group 1 to step once more", lambda: c.step(1) > events["back1"], wait_s)
    c.groups[1].kill(signal.SIGKILL)
    events["killed"] = c.step(0)
    c.wait("group 0 to step alone again", lambda: c.step(0) >= events["killed"] + down_steps, wait_s)
    events["restart2"] = c.step(0)
    c.start(1, *common)
    c.wait("group 1 to heal again", lambda: c.step(1) > events["restart2"], wait_s)
    events["back2"] = c.step(1)
    events["stop"] = max(c.step(0), c.step(1)) + 2
    c.stop_at(events["stop"])
    for gid in (0, 1):
        codes = c.wait_exit(gid, wait_s)
        assert codes == [0] * len(codes), f"group {gid} exited with {codes}\n{c.report()}"
    return events


def late_join(c: Cluster, *extra: str, ranks: int | None = None, join_at: int = 2, after: int = 2,
              pace: float = 0.3, wait_s: float = 300.0) -> dict[str, int]:
    """Group 0 starts alone; at its step ``join_at`` group 1 starts, heals from it and both step
    ``after`` more steps. Returns group 1's first committed step and the last step. ``pace``
    (least seconds a step takes) keeps group 0's steps few while group 1 starts."""
    c.start(0, "--pace", str(pace), *extra, ranks=ranks)
    c.wait(f"group 0 to reach step {join_at}", lambda: c.step(0) >= join_at, wait_s)
    c.start(1, "--pace", str(pace), *extra, ranks=ranks)
    c.wait("group 1 to heal and commit", lambda: any(r["committed"] for r in c.records(1)), wait_s)
    events = {"back": min(r["step"] for r in c.records(1) if r["committed"])}
    events["stop"] = max(c.step(0), c.step(1)) + after
    c.stop_at(events["stop"])
    for gid in (0, 1):
        codes = c.wait_exit(gid, wait_s)
        assert codes == [0] * len(codes), f"group {gid} exited with {codes}\n{c.report()}"
    return events
