"""Restart time of elastic training: lose one of two torchrun agents, then bring it back.

    python benchmarks/elastic.py            # the scenario of benchmarks/_agents.py, in a temporary folder

Runs [Note: what the scenario does] once (2 agents x 2 CPU workers, gloo, the tiny Llama of
the tests) and prints, for the shrink (4 -> 2, an agent SIGKILLed) and the grow (2 -> 4, the
agent started again), the restart time and its parts, from the workers' event log and the
surviving agent's log:

    detect      kill -> the first survivor's error (gloo "Connection closed by peer") or heartbeat exit
    agent       -> the agent saw the failed worker group (its monitor interval, the workers' exit)
    rendezvous  -> the agent's rendezvous completed and it started the new workers
    python      -> the new workers' first line (interpreter start, ``import torch``, shardwise)
    init        -> process group, heartbeat and mesh up
    load        -> model built and the newest checkpoint loaded (any world size)
    total       kill -> loaded; plus the steps lost (trained after the newest checkpoint, again)

For the grow, ``join`` is the new agent's start until the old workers were told to stop (its
own Python start and rendezvous join), then the same parts. Times are wall-clock seconds on
this machine, whose load they depend on (the Python start above all); no torch baseline:
torch has no elastic data position to compare with.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._agents import Scenario  # noqa: E402

_LOG_TIME = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*?\] (.*)$")


def agent_marks(text: str) -> list[tuple[float, str]]:
    """``(time.time(), message)`` of each line of a torchrun agent's log (local time)."""
    year = time.localtime().tm_year
    out = []
    for line in text.splitlines():
        m = _LOG_TIME.match(line)
        if m:
            mo, d, hh, mi, ss, msg = m.groups()
            base = time.mktime((year, int(mo), int(d), int(hh), int(mi), 0, 0, 0, -1))
            out.append((base + float(ss), msg))
    return out


def _first(marks: list[tuple[float, str]], after: float, needle: str) -> float:
    return min((t for t, m in marks if t >= after and needle in m), default=float("nan"))


def parts(events: list[dict], marks: list[tuple[float, str]], t0: float, detect_events: tuple[str, ...],
          trigger: str) -> dict[str, float]:
    after = [e for e in events if e["t"] >= t0]
    detect = min((e["t"] for e in after if e["event"] in detect_events), default=t0)
    noticed = _first(marks, detect, trigger)
    started = _first(marks, noticed, "Starting worker group")
    first = min(e["t"] for e in after if e["event"] == "start" and e["t"] >= started - 0.5)
    ready = min(e["t"] for e in after if e["event"] == "ready" and e["t"] >= first)
    loaded = min(e["t"] for e in after if e["event"] == "loaded" and e["t"] >= ready)
    out = {"detect": detect - t0, "agent": noticed - detect, "rendezvous": started - noticed, "python": first - started,
           "init": ready - first, "load": loaded - ready, "total": loaded - t0}
    if detect_events == ():  # a grow: the new agent's start and join come first
        out = {"join": out.pop("agent") + out.pop("detect"), **out}
    return out


def lost_steps(events: list[dict], t: float) -> int:
    """Steps trained before ``t`` and again after it."""
    before = {e["step"] for e in events if e["event"] == "step" and e["t"] < t}
    again = {e["step"] for e in events if e["event"] == "step" and e["t"] >= t}
    return len(before & again)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--every", type=int, default=3, help="--checkpoint-every")
    p.add_argument("--delay", type=float, default=0.6, help="--step-delay of the workers")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        s = Scenario(Path(d), steps=args.steps, every=args.every, delay=args.delay, deadline_s=600)
        t_start = time.time()
        events = s.run()
        wall = time.time() - t_start
        marks = agent_marks(s.agents[0].output())  # agent A survives throughout
    shrink = parts(events, marks, s.t_kill, ("error", "dead"), "Worker group FAILED")
    grow = parts(events, marks, s.t_regrow, (), "Stopping worker group")
    print(f"scenario: 2 agents x 2 gloo CPU workers, {args.steps} steps, checkpoint every {args.every}, "
          f"step delay {args.delay}s; wall {wall:.1f}s")
    for name, got, t in (("shrink 4 -> 2", shrink, s.t_kill), ("grow 2 -> 4", grow, s.t_regrow)):
        print(f"{name}: total {got['total']:.2f}s = " + " + ".join(f"{k} {v:.2f}" for k, v in got.items()
                                                               if k != "total")
              + f"; steps trained again: {lost_steps(events, t)}")


if __name__ == "__main__":
    main()
