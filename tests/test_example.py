"""The main job (examples/train.py) trains exactly like one process on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.data import global_batch, inputs_and_targets
from examples.model import Llama, LlamaConfig
from tests._dist import run_ranks

ARGS = ["--steps", "4", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
        "--seq-len", "16", "--batch-size", "8", "--log-every", "100"]


def _main_job(rank, world_size, argv):
    from examples.train import main

    return main(argv)


def _reference_losses(steps=4, dim=32, layers=2, heads=4, vocab=64, seq_len=16, batch=8, lr=3e-3, seed=0):
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                      max_seq_len=max(seq_len, LlamaConfig.max_seq_len))
    model = Llama(cfg, generator=torch.Generator().manual_seed(seed))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = inputs_and_targets(global_batch(step, batch, seq_len, vocab, seed))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "world_size,extra",
    [(2, []), (4, ["--dp-replicate", "2"]), (4, ["--tp", "2"])],
    ids=["fsdp2", "hsdp2x2", "fsdp2xtp2"],
)
def test_main_job_matches_single_process(world_size, extra):
    ref = _reference_losses()
    for rank, losses in enumerate(run_ranks(_main_job, world_size, ARGS + extra, timeout=120)):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs reference {b}"
        assert losses[-1] < losses[0], "the loss falls"


def test_stop_on_four_ranks_and_resume_on_two(tmp_path):
    """--save on a 4-rank FSDP run, --resume on a 2-rank run (another layout): the resumed
    steps continue exactly as uninterrupted training on one process."""
    ref = _reference_losses(steps=6)
    ckpt = str(tmp_path / "ckpt")
    first = ARGS[2:]  # drop "--steps 4"
    saved = run_ranks(_main_job, 4, ["--steps", "3", "--save", ckpt] + first, timeout=120)[0]
    resumed = run_ranks(_main_job, 2, ["--steps", "6", "--resume", ckpt] + first, timeout=120)[0]
    assert len(saved) == 3 and len(resumed) == 3
    for step, (a, b) in enumerate(zip(saved + resumed, ref), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs reference {b}"
