"""Issue 36, item 4: examples/train.py ``--save s3://...`` (then the printed ``--resume``
command) and ``--checkpoint-dir s3://...`` (elastic) against a local S3 server (moto on
127.0.0.1, `tests._s3`): the resumed runs train exactly like uninterrupted ones."""

from __future__ import annotations

import re

import pytest

from shardwise.checkpoint import latest_checkpoint
from tests._dist import run_ranks
from tests._s3 import fresh_prefix, s3_server
from tests.test_elastic_example import SMALL, _main
from tests.test_example import ARGS, ROOT, _hint_argv, _main_job_output, _reference_losses


@pytest.fixture(scope="module")
def s3_env():
    with s3_server() as env:
        yield env


def test_train_save_to_s3_then_the_printed_resume_command(s3_env, monkeypatch):
    monkeypatch.chdir(ROOT)
    ckpt = f"{fresh_prefix()}/ckpt"
    first = ARGS[2:]  # without "--steps 4"
    saved, out = run_ranks(_main_job_output, 2, ["--steps", "2", "--save", ckpt] + first, timeout=180, env=s3_env)[0]
    assert re.search(rf"saved step 2 to {re.escape(ckpt)}: \d+ bytes in \d+\.\d+s", out), out
    argv = _hint_argv(out, 2)
    assert argv[argv.index("--resume") + 1] == ckpt, argv
    resumed, out2 = run_ranks(_main_job_output, 1, argv, timeout=180, env=s3_env)[0]
    assert re.search(rf"loaded step 2 from {re.escape(ckpt)}: \d+ bytes read by 1 ranks", out2), out2
    ref = _reference_losses(steps=4)
    assert len(saved) == 2 and len(resumed) == 2, (saved, resumed)
    for step, (a, b) in enumerate(zip(saved + resumed, ref), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs reference {b}"


def test_elastic_checkpoint_dir_on_s3_resumes_at_another_world_size(s3_env, tmp_path):
    ck = f"{fresh_prefix()}/elastic"
    first = run_ranks(_main, 2, ["--steps", "3"] + SMALL + ["--checkpoint-dir", ck], timeout=180, env=s3_env)
    assert latest_checkpoint(ck) == f"{ck}/step-3"
    second = run_ranks(_main, 1, ["--steps", "5"] + SMALL + ["--checkpoint-dir", ck], timeout=180, env=s3_env)
    assert "resumed from" in second[0][1] and "(step 3, saved by 2 ranks) on 1 ranks" in second[0][1], second[0][1]
    assert latest_checkpoint(ck) == f"{ck}/step-5"
    ref = run_ranks(_main, 1, ["--steps", "5"] + SMALL + ["--checkpoint-dir", str(tmp_path / "ref")], timeout=180)
    losses = first[0][0] + second[0][0]
    assert len(losses) == 5, losses
    for step, (a, b) in enumerate(zip(losses, ref[0][0]), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs uninterrupted {b}"
