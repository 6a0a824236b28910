"""Two torchrun agents ("two hosts", 2 workers each): lose one mid-run, keep training on the other,
take it back when it returns; the loss of every step and its samples equal an uninterrupted run.

[Note: the time this test takes]
The scenario is three generations of workers (world 4, 2, 4), each paying a fresh Python start
(``import torch`` and shardwise: about 4 s on a quiet machine, 15-25 s on the shared 2-core
test machine) plus model build and load, and the steps are slowed (``delay``, 0.6 s) so that
the lone agent cannot finish before the returning one has started. It takes about 60 s on a
quiet machine and 2-3 minutes on a loaded one: the longest test of the suite, bounded by the
scenario's deadline. ``benchmarks/elastic.py`` runs the same scenario and prints the restart
time and its parts.
"""

from __future__ import annotations

import json
from collections import Counter

from benchmarks._agents import Scenario, train_args
from tests._dist import run_ranks


def _reference(rank, world_size, argv):
    from examples.train import main

    return main(argv)


def test_lose_an_agent_then_get_it_back_same_losses_same_samples(tmp_path):
    (tmp_path / "run").mkdir()
    scenario = Scenario(tmp_path / "run", deadline_s=400)
    events = scenario.run()

    loads = [e for e in events if e["event"] == "loaded" and e["t"] > scenario.t_kill]
    assert [e["world"] for e in loads] == [2, 4], f"resumed at {loads}: world 2 after the loss, 4 after the return"
    assert loads[0]["saved_world"] == 4 and loads[1]["saved_world"] == 2, loads
    steps: dict[int, list[dict]] = {}
    for e in events:
        if e["event"] == "step":
            steps.setdefault(e["step"], []).append(e)
    assert sorted(steps) == list(range(1, scenario.steps + 1)), sorted(steps)
    assert {e["world"] for s in steps.values() for e in s} == {2, 4}
    lost = [s for s, rec in steps.items() if len(rec) > 1]
    assert lost, "the steps after the last checkpoint were trained again after a restart"
    result = [e for e in events if e["event"] == "result"][-1]["line"]
    assert f"steps={scenario.steps} " in result and f"samples={scenario.steps * 8} " in result, result

    # the uninterrupted run: the same arguments at a fixed world size, without the step delay
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    argv = train_args(ref_dir, scenario.steps, scenario.every, 0.0, hb_timeout=0)
    ref_losses = run_ranks(_reference, 2, argv, timeout=300)[0]
    ref_samples = {}
    for line in (ref_dir / "events").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "step":
            ref_samples[e["step"]] = e["samples"]
    for s, records in sorted(steps.items()):
        want = ref_losses[s - 1]
        for e in records:  # a step trained twice (before and after a restart) gives the same numbers
            assert abs(e["loss"] - want) <= 1e-6 * abs(want), f"step {s} at world {e['world']}: {e['loss']} vs {want}"
            assert Counter(e["samples"]) == Counter(ref_samples[s]), f"step {s}: other samples"
    seen = Counter(i for s in steps for i in steps[s][-1]["samples"])
    assert seen == Counter(i for s in ref_samples for i in ref_samples[s])
