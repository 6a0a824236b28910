"""async_save (snapshot at return, errors at wait), keep_last rotation, replacing a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.checkpoint import CheckpointError, async_save, load, save, verify_checkpoint
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, build, full, train


def _async_snapshot(rank, world_size, path):
    import threading

    from shardwise.checkpoint._save import _save_handle as _writer

    mutated = threading.Event()
    real = _writer._write_file
    _writer._write_file = lambda *a: (mutated.wait(), real(*a))[1]  # the files are written after the changes
    model, optim = build("fsdp2")
    train(model, optim, 1)
    state = app_state(model, optim, step=1)
    want = full(state)
    handle = async_save(state, path)
    with torch.no_grad():  # change everything in place
        for p in model.parameters():
            p.to_local().add_(1.0)
        for s in optim.state.values():
            s["exp_avg"].to_local().mul_(-1.0)
    state["trainer"]["step"] = 99
    mutated.set()
    handle.wait()
    handle.wait()  # a second wait does nothing
    model2, optim2 = build("fsdp2", seed=9)
    state2 = app_state(model2, optim2)
    load(state2, path)
    return full(state2), want, state2["trainer"]["step"], handle.done()


def test_async_save_holds_the_values_of_the_moment_it_returned(tmp_path):
    for rank, (got, want, step, done) in enumerate(run_ranks(_async_snapshot, 2, str(tmp_path / "a"))):
        assert_equal_states(got, want, f"rank {rank}")
        assert step == 1 and done


def _async_failure(rank, world_size, path):
    from shardwise.checkpoint._save import _save_handle as _writer

    if rank == 1:
        def fail(*args):
            raise OSError(28, "No space left on device")

        _writer._write_file = fail
    model, optim = build("fsdp2")
    handle = async_save(app_state(model, optim), path)
    try:
        handle.wait()
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_async_save_error_surfaces_on_wait_on_every_rank(tmp_path):
    messages = run_ranks(_async_failure, 2, str(tmp_path / "a"))
    assert messages[0] == messages[1]
    assert "rank 1: OSError: [Errno 28] No space left on device" in messages[0], messages[0]
    assert os.listdir(tmp_path) == [], "no checkpoint and no temporary directory"


def test_keep_last_and_replacing_a_checkpoint_single_process(tmp_path):
    """Without torch.distributed (one process) the same calls work."""
    model = torch.nn.Linear(3, 2)
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.fill_(step)
        save({"model": model.state_dict(), "step": step}, tmp_path / f"step-{step}", keep_last=2)
    assert sorted(os.listdir(tmp_path)) == [".shardwise-series.json", "step-3", "step-4"]
    with torch.no_grad():
        model.weight.fill_(7)
    save({"model": model.state_dict(), "step": 7}, tmp_path / "step-3")  # replace an existing one
    assert sorted(os.listdir(tmp_path)) == [".shardwise-series.json", "step-3", "step-4"] and verify_checkpoint(tmp_path / "step-3").ok
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "step": 0}
    load(state, tmp_path / "step-3")
    assert state["step"] == 7 and torch.equal(state["model"]["weight"], torch.full((2, 3), 7.0))
    with pytest.raises(ValueError, match="keep_last"):
        save({"step": 1}, tmp_path / "x", keep_last=0)
