"""save_training_state / load_training_state: resume exactly (RNG, scheduler, step), at other world sizes too."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from shardwise.checkpoint import CheckpointError, load_training_state, save, save_training_state
from tests._dist import run_ranks

TOL = 1e-6


class DropBlock(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.lin(x)))


class DropNet(nn.Module):
    def __init__(self, p=0.3):
        super().__init__()
        self.blocks = nn.ModuleList(DropBlock(p) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _setup(seed, p):
    from shardwise.composable import fully_shard

    torch.manual_seed(seed)
    model = DropNet(p)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def _step_random(model, optim, sched):
    """A step drawing from every per-rank generator: data and dropout (torch), a loss scale (random)."""
    x = torch.randn(4, 8)
    loss = model(x).square().mean() * (1 + random.random())
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()


def _exact(rank, world_size, path, mode):
    model, optim, sched = _setup(0 if not mode.startswith("resume") else 999, 0.3)
    ts = None
    if mode.startswith("resume"):
        torch.manual_seed(12345)
        random.seed(12345)
        ts = load_training_state(path, model, optim, scheduler=sched, rng=mode != "resume-without-rng")
    else:
        torch.manual_seed(100 + rank)  # every rank its own stream
        random.seed(200 + rank)
    for step in range(ts.step if ts else 0, 6):
        if mode == "save" and step == 3:
            save_training_state(path, model, optim, scheduler=sched, step=3, extra={"epoch": 1, "batch": 17})
            return None
        _step_random(model, optim, sched)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return params, optim.param_groups[0]["lr"], ts


def test_resume_is_bit_exact_with_dropout_rng_scheduler_and_step(tmp_path):
    path = str(tmp_path / "state")
    straight = run_ranks(_exact, 2, path, "straight", timeout=90)
    run_ranks(_exact, 2, path, "save", timeout=90)
    resumed = run_ranks(_exact, 2, path, "resume", timeout=90)
    no_rng = run_ranks(_exact, 2, path, "resume-without-rng", timeout=90)
    for rank in range(2):
        params, lr, ts = resumed[rank]
        assert ts.step == 3 and ts.extra == {"epoch": 1, "batch": 17}, ts
        assert set(ts.rng.values()) == {"per-rank"} and {"torch", "python"} <= set(ts.rng), ts
        assert ts.saved_world_size == 2, ts
        assert lr == straight[rank][1] == 0.1 * 0.5 ** 3, (lr, straight[rank][1])
        for n, p in straight[rank][0].items():
            assert torch.equal(params[n], p), (rank, n, "resumed training differs from uninterrupted training")
        assert no_rng[rank][2].rng == {}
        assert not torch.equal(no_rng[rank][0]["head.weight"], straight[rank][0]["head.weight"]), \
            "the RNG states matter here: without them the run differs"


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(8, 8, generator=g) for _ in range(6)]


def _resharded(rank, world_size, path, mode, seed_per_rank):
    model, optim, sched = _setup(0 if mode != "resume" else 999, 0.0)
    ts = None
    if mode == "resume":
        ts = load_training_state(path, model, optim, scheduler=sched)
    else:
        torch.manual_seed(100 + (rank if seed_per_rank else 0))
        random.seed(100 + (rank if seed_per_rank else 0))
    per = 8 // world_size
    for step in range(ts.step if ts else 0, 6):
        if mode == "save" and step == 3:
            save_training_state(path, model, optim, scheduler=sched, step=3)
            return torch.rand(4)  # the draws a continued run would make next
        x = _batches()[step][rank * per:(rank + 1) * per]
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return {n: p.full_tensor() for n, p in model.named_parameters()}, ts, torch.rand(4)


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(tmp_path, world):
    path = str(tmp_path / "state")
    straight = run_ranks(_resharded, 2, path, "straight", False, timeout=90)[0][0]
    next_draw = run_ranks(_resharded, 2, path, "save", False, timeout=90)
    resumed = run_ranks(_resharded, world, path, "resume", False, timeout=90)
    for rank, (params, ts, draw) in enumerate(resumed):
        assert ts.rng["torch"] == ts.rng["python"] == "shared", ts
        assert ts.saved_world_size == 2 and ts.step == 3, ts
        assert torch.equal(draw, next_draw[0]), (rank, "every rank continues the common stream")
        for n, p in straight.items():
            err = ((params[n] - p).abs().max() / p.abs().max()).item()
            assert err <= TOL, (rank, n, err)


def test_per_rank_rng_on_another_world_size_wraps(tmp_path):
    path = str(tmp_path / "state")
    next_draw = run_ranks(_resharded, 2, path, "save", True, timeout=90)
    assert not torch.equal(next_draw[0], next_draw[1])
    for world in (3, 1):
        got = run_ranks(_first_draw, world, path, timeout=90)
        for rank, (draw, rng) in enumerate(got):
            assert rng["torch"] == rng["python"] == "wrapped", rng
            assert torch.equal(draw, next_draw[rank % 2]), (world, rank, "rank r continues saved rank r mod 2")


def _first_draw(rank, world_size, path):
    model, optim, sched = _setup(999, 0.0)
    ts = load_training_state(path, model, optim, scheduler=sched)
    return torch.rand(4), ts.rng


def test_a_plain_checkpoint_is_not_a_training_state(tmp_path):
    model = DropNet()
    save({"model": model.state_dict()}, str(tmp_path / "plain"))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="not a training state"):
        load_training_state(str(tmp_path / "plain"), model, optim)
    with pytest.raises(CheckpointError, match="extra must be JSON-serialisable"):
        save_training_state(str(tmp_path / "bad"), model, optim, extra={"t": torch.zeros(1)})


def test_numpy_rng_row_without_numpy_names_the_row_and_the_fix(tmp_path, monkeypatch):
    import sys

    import numpy  # noqa: F401  (the saving job used numpy: its state is saved as rng/numpy)

    model = DropNet()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "ts")
    save_training_state(path, model, optim, step=3)
    monkeypatch.setitem(sys.modules, "numpy", None)  # numpy not installed where it is loaded
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"rng/numpy.*install numpy.*rng=False"):
        load_training_state(path, model, optim)
    assert torch.equal(torch.get_rng_state(), before), "no generator is restored halfway"
    assert load_training_state(path, model, optim, rng=False).step == 3

