"""Two torchrun agents on this machine ("two hosts"): lose one mid-run, then bring it back.

The driver behind ``tests/test_elastic_agents.py`` and ``benchmarks/elastic.py``. Each agent is

    python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 2 --max-restarts R
        --rdzv-backend c10d --rdzv-endpoint localhost:PORT --rdzv-id ID --rdzv-conf ...
        examples/train.py --checkpoint-dir DIR --checkpoint-every K --event-log EVENTS ...

Agent A hosts the rendezvous store (``is_host=1``); agent B joins it as a client (``is_host=0``).

[Note: what the scenario does]
1. both run at world 4 until a checkpoint is committed and a later step trained;
2. B is lost as a host is: its agent and its workers are SIGKILLed (the agent first, so it
   cannot restart them). A's workers fail in their next collective (or by heartbeat), A's agent
   restarts them; the rendezvous drops B (its keep-alive stops) and completes with A alone:
   world 2, from the newest complete checkpoint;
3. once a checkpoint is committed at world 2, B starts again: A's agent sees a node waiting,
   restarts its workers, and the job continues at world 4 from the newest checkpoint, to the end.
   ``delay`` per step keeps A from finishing alone while B's agent starts (seconds of imports).
The rendezvous settings shorten torchrun's waits (``last_call_timeout`` 30 s, keep-alive 5 s x
3 by default) to fit a test; a real cluster keeps the defaults (docs/elastic.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# keep-alive 1 s x 10: an agent starved of CPU for a few seconds (2 cores, 4 busy workers, a new
# agent starting) must not be taken for dead, which would let a joining agent form a round alone
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=10,close_timeout=5"
# torch issue #135712: with the agents' shared store, restarted workers can read the previous
# generation's addresses (gloo "connectFullMesh ... Connection refused"); a store per generation
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
             "LOGLEVEL": "INFO"}  # the agents log their rendezvous and restarts (benchmarks/elastic.py reads them)
MODEL = ["--dim", "32", "--layers", "1", "--heads", "4", "--vocab", "64", "--seq-len", "16", "--batch-size", "8",
         "--dataset-size", "28", "--log-every", "1000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_args(workdir: Path, steps: int, every: int, delay: float, hb_timeout: float = 3.0) -> list[str]:
    return MODEL + ["--steps", str(steps), "--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", str(every),
                    "--event-log", str(workdir / "events"), "--step-delay", str(delay), "--heartbeat-timeout",
                    str(hb_timeout), "--heartbeat-interval", "0.5", "--collective-timeout", "60"]


def agent_command(port: int, args: list[str], host: bool, max_restarts: int = 5) -> list[str]:
    """``host``: this agent hosts the rendezvous store (``is_host`` of ``--rdzv-conf``; torchrun
    would otherwise let the first agent that binds the port host it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", "shardwise-elastic", "--rdzv-conf", f"{RDZV_CONF},is_host={int(host)}", "--monitor-interval", "0.1",
            "examples/train.py", *args]


def events(workdir: Path) -> list[dict]:
    path = workdir / "events"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
    return kids


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> list[int]:
        """SIGKILL the agent, then its workers (as a host that loses power); returns the workers' pids."""
        workers = _children(self.proc.pid)
        self.proc.kill()
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        return workers

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_agent(name: str, workdir: Path, port: int, args: list[str], host: bool = False) -> Agent:
    log = workdir / f"agent-{name}-{int(time.time() * 1000)}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **AGENT_ENV)
    with open(log, "w") as out:
        proc = subprocess.Popen(agent_command(port, args, host), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Agent(name, proc, log)


class ScenarioError(AssertionError):
    pass


@dataclass
class Scenario:
    """One run of [Note: what the scenario does]; times are ``time.time()``."""

    workdir: Path
    steps: int = 60  # the lone agent must not finish before the returning one has joined (~10-20 s here)
    every: int = 3
    delay: float = 0.6
    grow: bool = True
    deadline_s: float = 240.0
    port: int = field(default_factory=free_port)
    agents: list[Agent] = field(default_factory=list)
    t_kill: float = 0.0
    t_regrow: float = 0.0

    def _wait(self, what: str, pred, until: float) -> dict:
        while time.time() < until:
            for e in events(self.workdir):
                if pred(e):
                    return e
            dead = [a for a in self.agents if a.proc.poll() not in (None, 0) and a.proc.returncode != -9]
            if dead:
                raise ScenarioError(f"agent {dead[0].name} exited with {dead[0].proc.returncode} while waiting for "
                                    f"{what}:\n{dead[0].output()[-3000:]}")
            time.sleep(0.05)
        raise ScenarioError(f"timed out waiting for {what}; events: {events(self.workdir)[-5:]}\n"
                            + "\n".join(f"--- {a.name}\n{a.output()[-2000:]}" for a in self.agents))

    def run(self) -> list[dict]:
        end = time.time() + self.deadline_s
        args = train_args(self.workdir, self.steps, self.every, self.delay)
        try:
            self.agents.append(start_agent("A", self.workdir, self.port, args, host=True))
            b = start_agent("B", self.workdir, self.port, args)  # joins A's store (it retries until A is up)
            self.agents.append(b)
            # if A's first round closes before B joins, A runs at world 2 and grows to 4 when B comes
            saved = self._wait("a checkpoint at world 4", lambda e: e["event"] == "saved" and e["world"] == 4, end)
            self._wait("a step at world 4 after it",
                       lambda e: e["event"] == "step" and e["world"] == 4 and e["step"] > saved["step"], end)
            self.t_kill = time.time()
            b.kill()
            loaded = self._wait("the resume at world 2", lambda e: e["event"] == "loaded" and e["world"] == 2, end)
            if self.grow:
                self._wait("a checkpoint at world 2", lambda e: e["event"] == "saved" and e["world"] == 2
                           and e["t"] > loaded["t"], end)
                self.t_regrow = time.time()
                self.agents.append(start_agent("B2", self.workdir, self.port, args))
                self._wait("the resume at world 4", lambda e: e["event"] == "loaded" and e["world"] == 4
                           and e["t"] > loaded["t"], end)
            for a in self.agents:
                if a is b:
                    continue
                try:
                    a.proc.wait(max(1.0, end - time.time()))
                except subprocess.TimeoutExpired:
                    raise ScenarioError(f"agent {a.name} did not finish:\n{a.output()[-3000:]}") from None
                if a.proc.returncode != 0:
                    raise ScenarioError(f"agent {a.name} exited with {a.proc.returncode}:\n{a.output()[-3000:]}")
            return events(self.workdir)
        finally:
            for a in self.agents:
                if a.proc.poll() is None:
                    a.kill()

