"""examples/train.py --pp: the same losses as one process on the global batch (1e-6), and a
checkpoint saved at --pp 2 resumes at --pp 1."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.test_example import ARGS, _main_job, _reference_losses

ARGS4 = [a if a != "2" or ARGS[i - 1] != "--layers" else "4" for i, a in enumerate(ARGS)]
ARGS4[ARGS4.index("--steps") + 1] = "3"


@pytest.mark.parametrize("world_size,extra", [
    (4, ["--pp", "2", "--tp", "2", "--schedule", "gpipe", "--microbatches", "4", "--pp-cost", "params"]),
    (4, ["--pp", "2", "--dp-replicate", "2", "--schedule", "interleaved_1f1b", "--microbatches", "2"]),
    (4, ["--pp", "2", "--tp", "2", "--schedule", "zb_h1", "--microbatches", "4", "--pp-cost", "params"]),
    (4, ["--pp", "2", "--dp-shard", "2", "--schedule", "zb_h1", "--microbatches", "2"]),
    (4, ["--pp", "2", "--dp-shard", "2", "--schedule", "zbv", "--microbatches", "2"]),
    (4, ["--pp", "2", "--tp", "2", "--schedule", "interleaved_zb", "--microbatches", "2", "--pp-cost", "params"]),
    (4, ["--pp", "2", "--tp", "2", "--schedule", "dualpipev", "--microbatches", "4", "--pp-cost", "params"]),
], ids=["pp2xtp2-gpipe", "pp2xhsdp-interleaved", "pp2xtp2-zb_h1", "pp2xfsdp-zb_h1", "pp2xfsdp-zbv", "pp2xtp2-izb",
        "pp2xtp2-dualpipev"])
def test_train_pp_matches_single_process(world_size, extra):
    ref = _reference_losses(steps=3, layers=4)
    for rank, losses in enumerate(run_ranks(_main_job, world_size, ARGS4 + extra, timeout=150)):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs reference {b}"


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_save_at_pp2_resume_at_pp1(tmp_path, schedule):
    """zbv: the V placement (rank 0 holds the first and the last stage) saves the same checkpoint."""
    ref = _reference_losses(steps=4, layers=4)
    path = str(tmp_path / "ck")
    first = ARGS4[2:]
    run_ranks(_main_job, 2, ["--steps", "2", "--save", path, "--pp", "2", "--schedule", schedule] + first,
              timeout=120)
    resumed = run_ranks(_main_job, 1, ["--steps", "4", "--resume", path] + first, timeout=120)[0]
    assert len(resumed) == 2
    for step, (a, b) in enumerate(zip(resumed, ref[2:]), 3):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: resumed {a} vs uninterrupted {b}"
