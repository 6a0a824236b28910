"""Profiler ranges of checkpoint phases: a trace of a save and a load shows each phase by name.

The names are listed in docs/checkpoint.md ("Reading a profiler trace").
"""

from __future__ import annotations

import threading

import torch
from torch.profiler import ProfilerActivity, profile

from shardwise.checkpoint import async_save, load, save

SAVE = ["shardwise.checkpoint.save/plan", "shardwise.checkpoint.save/owners", "shardwise.checkpoint.save/prepare",
        "shardwise.checkpoint.save/write", "shardwise.checkpoint.save/commit"]
LOAD = ["shardwise.checkpoint.load/index", "shardwise.checkpoint.load/plan", "shardwise.checkpoint.load/verify",
        "shardwise.checkpoint.load/read"]


def _state(fill: float | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g)}, "step": 3}
    if fill is not None:
        state["model"] = {k: torch.full_like(v, fill) for k, v in state["model"].items()}
        state["step"] = 0
    return state


def _counts(prof) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("shardwise.checkpoint."):
            out[e.name] = out.get(e.name, 0) + 1
    return out


def test_a_trace_of_save_and_load_shows_every_phase_once(tmp_path):
    src, dst = _state(), _state(fill=0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        save(src, tmp_path / "ck")
        load(dst, tmp_path / "ck")
    counts = _counts(prof)
    missing = [n for n in SAVE + LOAD if n not in counts]
    assert not missing, f"ranges missing from the trace: {missing}; seen: {sorted(counts)}"
    assert all(counts[n] == 1 for n in SAVE + LOAD), f"one range per phase and call: {counts}"
    assert "shardwise.checkpoint.save/snapshot" not in counts, "a synchronous save takes no snapshot"
    assert torch.equal(dst["model"]["w"], src["model"]["w"]) and dst["step"] == 3


def test_the_ranges_nest_the_phases_in_order(tmp_path):
    """Save phases come one after another (plan before owners before write before commit)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        save(_state(), tmp_path / "ck")
    start = {e.name: e.time_range.start for e in prof.events() if e.name.startswith("shardwise.checkpoint.")}
    assert [n for n in sorted(start, key=start.get)] == SAVE, start


def test_an_async_save_shows_its_snapshot_and_commit_and_writes_in_a_named_range(tmp_path, monkeypatch):
    """torch's profiler records the threads it was started on, so the background write of an
    async save is not in this trace (docs/checkpoint.md says so); its range is still opened,
    on the writing thread."""
    from shardwise.checkpoint._save import _save_handle as _writer

    opened, real = [], _writer.phase

    def spy(name):
        opened.append((name, threading.current_thread() is threading.main_thread()))
        return real(name)

    monkeypatch.setattr(_writer, "phase", spy)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        handle = async_save(_state(), tmp_path / "ck")
        handle.wait()
    counts = _counts(prof)
    want = ["shardwise.checkpoint.save/snapshot", "shardwise.checkpoint.save/commit"]
    assert all(counts.get(n) == 1 for n in want), counts
    assert ("save/write", False) in opened, opened
