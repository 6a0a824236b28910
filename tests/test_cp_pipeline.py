"""Context parallelism inside a pipeline (examples/train.py ``--cp 2 --pp 2``, 4 ranks): every
stage's attention on its own cp ring, the zigzag positions fed to every stage, the stage
weights ``fully_shard``-ed over ``dp_shard`` x ``cp``; the losses equal one process training on
the whole global batch (fp32, 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from shardwise.composable import feed_positions
from tests._dist import run_ranks
from tests.test_example import _main_job, _reference_losses

SEQ = 32
ARGS = ["--steps", "3", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
        "--seq-len", str(SEQ), "--batch-size", "4", "--log-every", "100"]


@pytest.mark.parametrize("extra", [
    ["--cp", "2", "--pp", "2"],
    ["--cp", "2", "--pp", "2", "--schedule", "zb_h1", "--microbatches", "2", "--cp-method", "allgather"],
], ids=["cp2xpp2-1f1b", "cp2xpp2-zb_h1-allgather"])
def test_cp_pp_training_matches_one_process(extra):
    ref = _reference_losses(steps=3, seq_len=SEQ, batch=4)
    for rank, losses in enumerate(run_ranks(_main_job, 4, ARGS + extra, timeout=180)):
        assert len(losses) == len(ref), (rank, losses)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs reference {b} ({extra})"


class _Echo(torch.nn.Module):
    def forward(self, x, position_ids=None):
        return position_ids


def test_feed_positions_adds_the_keyword_until_removed():
    m = _Echo()
    pos = torch.arange(4)
    h = feed_positions(m, pos)
    assert m(torch.zeros(1)) is pos
    own = torch.arange(2)
    assert m(torch.zeros(1), position_ids=own) is own  # a call that passes its own is left alone
    h.position_ids = pos + 1  # read at every call
    assert torch.equal(m(torch.zeros(1)), pos + 1)
    h.remove()
    assert m(torch.zeros(1)) is None
    with pytest.raises(TypeError, match="position_ids must be a tensor"):
        feed_positions(m, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a keyword"):
        feed_positions(m, pos, keyword="1x")
