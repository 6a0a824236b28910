"""``examples/train.py --optimizer muon``: Muon on the hidden matrices (each updated whole by its
owner rank) and AdamW on the rest trains like one process running torch.optim.Muon and AdamW on
the same split. Losses agree within `TOL` relative: the sharded gradients differ from one
process's in the last bits and Muon's bf16 Newton-Schulz can round those differently
(tests/test_whole_matrix.py: with equal gradients the update is bit-equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.data import global_batch, inputs_and_targets
from examples.model import Llama, LlamaConfig
from examples.optimizers import MUON_LR
from shardwise.composable.optim import split_matrix_params
from tests._dist import run_ranks
from tests.test_example import ARGS, _main_job

TOL = 1e-3


def _reference_losses(steps=4, dim=32, layers=2, heads=4, vocab=64, seq_len=16, batch=8, lr=3e-3, seed=0):
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                      max_seq_len=max(seq_len, LlamaConfig.max_seq_len))
    model = Llama(cfg, generator=torch.Generator().manual_seed(seed))
    matrices, others = split_matrix_params(model, skip=[model.output])
    optims = [torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=0.0), torch.optim.AdamW(others, lr=lr)]
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = inputs_and_targets(global_batch(step, batch, seq_len, vocab, seed))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        for o in optims:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in optims:
            o.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world_size,extra", [(2, []), (4, ["--tp", "2"])], ids=["fsdp2", "fsdp2xtp2"])
def test_muon_job_matches_single_process(world_size, extra):
    ref = _reference_losses()
    for rank, losses in enumerate(run_ranks(_main_job, world_size, ARGS + ["--optimizer", "muon"] + extra,
                                            timeout=300)):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank} step {step}: {a} vs reference {b}"
        assert losses[-1] < losses[0], "the loss falls"


def test_muon_outside_the_plain_loop_is_refused(monkeypatch, capsys, tmp_path):
    from examples.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        main(["--optimizer", "muon", "--pp", "2"])
    assert e.value.code == 2
    assert "--optimizer muon is wired into the plain" in capsys.readouterr().err


def test_muon_job_saved_on_four_ranks_resumes_on_two(tmp_path):
    """Both optimizers' state (Muon's on its owners) goes through --save / --resume at another
    world size: the resumed steps match one process that never stopped."""
    ckpt = str(tmp_path / "ck")
    base = ARGS + ["--optimizer", "muon"]  # the last --steps wins
    run_ranks(_main_job, 4, base + ["--steps", "3", "--save", ckpt], timeout=300)
    resumed = run_ranks(_main_job, 2, base + ["--steps", "5", "--resume", ckpt], timeout=300)[0]
    ref = _reference_losses(steps=5)[3:]
    assert len(resumed) == 2, resumed
    for step, (a, b) in enumerate(zip(resumed, ref), 4):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: {a} vs reference {b}"
