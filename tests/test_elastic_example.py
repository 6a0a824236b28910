"""examples/train.py --checkpoint-dir: a run stopped at 4 ranks resumes by itself at 2 and then 1,
with the losses (fp32, <= 1e-6 relative) and the samples of every step of an uninterrupted run;
the result line states steps, samples and the final loss."""

from __future__ import annotations

import contextlib
import io
import json
from collections import Counter

from examples.elastic import parse_result, result_line
from shardwise.checkpoint import latest_checkpoint
from tests._dist import run_ranks

SMALL = ["--dim", "32", "--layers", "1", "--heads", "4", "--vocab", "64", "--seq-len", "16", "--batch-size", "8",
         "--dataset-size", "20", "--checkpoint-every", "2", "--heartbeat-timeout", "0", "--log-every", "100"]


def _main(rank, world_size, argv):
    from examples.train import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = main(argv)
    return losses, out.getvalue()


def _steps(log) -> dict[int, dict]:
    """The last record of each step (a step trained again after a restart replaces the first)."""
    got = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "step":
            got[e["step"]] = e
    return got


def test_stop_at_four_resume_at_two_then_one_equals_an_uninterrupted_run(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "events"
    argv = SMALL + ["--checkpoint-dir", str(ck), "--event-log", str(log)]
    first = run_ranks(_main, 4, ["--steps", "3"] + argv, timeout=120)
    assert latest_checkpoint(ck) == str(ck / "step-3")
    second = run_ranks(_main, 2, ["--steps", "5"] + argv, timeout=120)
    assert "resumed from" in second[0][1] and "(step 3, saved by 4 ranks) on 2 ranks" in second[0][1], second[0][1]
    third = run_ranks(_main, 1, ["--steps", "7"] + argv, timeout=120)
    ref_log = tmp_path / "ref-events"
    ref = run_ranks(_main, 2, ["--steps", "7"] + SMALL + ["--checkpoint-dir", str(tmp_path / "ref"),
                                                         "--event-log", str(ref_log)], timeout=120)
    losses = first[0][0] + second[0][0] + third[0][0]
    assert len(losses) == 7
    for step, (a, b) in enumerate(zip(losses, ref[0][0]), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs uninterrupted {b}"
    got, want = _steps(log), _steps(ref_log)
    assert sorted(got) == list(range(1, 8)) and [got[s]["world"] for s in (1, 4, 7)] == [4, 2, 1]
    for s in range(1, 8):
        assert Counter(got[s]["samples"]) == Counter(want[s]["samples"]), f"step {s}"
    # 7 steps of 8 over 20 samples: epochs of 24 positions (the last batch padded from the start)
    seen = Counter(i for s in range(1, 8) for i in got[s]["samples"])
    assert sum(seen.values()) == 56 and set(seen) == set(range(20))
    result = parse_result(third[0][1])
    assert result == {"steps": 7, "trained": 2, "samples": 56, "loss": third[0][0][-1]}, result
    assert third[0][1].rstrip().splitlines()[-1].startswith("result: ")
    # nothing left: resumes, trains nothing, states the same result
    again = run_ranks(_main, 1, ["--steps", "7"] + argv, timeout=120)
    assert again[0][0] == [] and parse_result(again[0][1])["loss"] == result["loss"], again[0][1]


def test_result_line_round_trips():
    line = result_line(30, 10, 480, 1.2345678901234567)
    assert parse_result(line) == {"steps": 30, "trained": 10, "samples": 480, "loss": 1.2345678901234567}
    assert parse_result(result_line(3, 0, 0, None))["loss"] != parse_result(result_line(3, 0, 0, None))["loss"]
