"""ElasticSampler / ElasticLoader: one global order per (seed, epoch), resumed at any data-parallel size.

Most of it is arithmetic (hypothesis, no processes): a run that changes its data-parallel size
at a step boundary reads, step for step, the same global batches as a run that never did; with
``global_batch == world size`` every rank reads exactly what torch's DistributedSampler gives
it. One multi-rank test saves the position with save_training_state on a (dp_shard 2, tp 2) mesh
and loads it at 2 ranks.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from shardwise.checkpoint import (CheckpointError, ElasticLoader, ElasticSampler, latest_checkpoint,
                                  load_training_state, plan_batches, save, save_training_state)
from tests._dist import run_ranks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _samplers(n, batch, dp, **kw):
    return [ElasticSampler(n, batch, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]


def _step(samplers) -> list[int]:
    """One optimizer step on every rank: the global batch (rank-major), advancing each sampler."""
    out = []
    for s in samplers:
        for _ in range(s.plan.accumulation):
            out += next(iter(s))
    return out


def _run(n, batch, sizes_and_steps, **kw) -> list[list[int]]:
    """Global batches of a run that trains ``steps`` steps at each ``(dp, micro)`` in turn,
    passing the position through state_dict / load_state_dict at each change."""
    batches, state = [], None
    for dp, micro, steps in sizes_and_steps:
        samplers = _samplers(n, batch, dp, micro_batch=micro, **kw)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        for _ in range(steps):
            batches.append(_step(samplers))
        states = [s.state_dict() for s in samplers]
        assert all({k: v for k, v in x.items() if k != "dp_size"} == {k: v for k, v in states[0].items()
                   if k != "dp_size"} for x in states)
        state = states[0]
    return batches


@st.composite
def _resized_runs(draw):
    n = draw(st.integers(1, 40))
    batch = draw(st.integers(1, 12))
    drop_last = draw(st.booleans()) and n >= batch
    legs = []
    for _ in range(draw(st.integers(2, 3))):
        dp = draw(st.sampled_from(_divisors(batch)))
        micro = draw(st.sampled_from([None, *_divisors(batch // dp)]))
        legs.append((dp, micro, draw(st.integers(0, 9))))
    return n, batch, drop_last, legs, draw(st.booleans()), draw(st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(_resized_runs())
def test_a_resized_run_reads_the_global_batches_of_an_uninterrupted_one(case):
    n, batch, drop_last, legs, shuffle, seed = case
    kw = {"drop_last": drop_last, "shuffle": shuffle, "seed": seed}
    resized = _run(n, batch, legs, **kw)
    total = sum(steps for _, _, steps in legs)
    straight = _run(n, batch, [(1, None, total)], **kw)
    assert [sorted(b) for b in resized] == [sorted(b) for b in straight]
    # the union over the run: every epoch is its order (padded or cut to global batches)
    per_epoch = ElasticSampler(n, batch, **kw).batches_per_epoch
    seen: Counter = Counter(i for b in resized for i in b)
    full_epochs, rest = divmod(total, per_epoch)
    expected: Counter = Counter()
    s = ElasticSampler(n, batch, **kw)
    for e in range(full_epochs + (rest > 0)):
        s.set_epoch(e)
        order = s.order()
        steps = per_epoch if e < full_epochs else rest
        expected.update(order[p % n] for p in range(steps * batch))
    assert seen == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 50), st.integers(1, 8), st.booleans(), st.booleans(), st.integers(0, 5), st.integers(0, 3))
def test_global_batch_equal_to_the_world_size_is_torchs_distributed_sampler(n, world, shuffle, drop_last, seed,
                                                                            epoch):
    if drop_last and n < world:
        return  # torch yields empty epochs; ElasticSampler refuses (tested below)
    for rank in range(world):
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
        ref.set_epoch(epoch)
        mine = ElasticSampler(n, world, dp_rank=rank, dp_size=world, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)
        mine.set_epoch(epoch)
        assert [i for b in mine for i in b] == list(ref)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.sampled_from([None, 1, 2, 3, 4]))
def test_plan_keeps_the_global_batch_or_says_why_not(batch, dp, micro):
    try:
        plan = plan_batches(batch, dp, micro)
    except ValueError as e:
        assert str(batch) in str(e) and str(dp) in str(e)
        assert batch % dp or (micro is not None and (batch // dp) % micro)
        return
    assert plan.dp_size * plan.micro_batch * plan.accumulation == batch


def test_set_epoch_keeps_the_current_epochs_position_and_restarts_another():
    s = ElasticSampler(10, 4, seed=1)
    first = next(iter(s))
    s.set_epoch(0)
    assert s.consumed == 4 and next(iter(s)) != first
    s.set_epoch(3)
    assert (s.epoch, s.consumed) == (3, 0)
    assert [i for b in s for i in b][:4] != first and s.epoch == 4  # the epoch ran out: the next one is due


def test_resume_inside_a_global_batch_only_at_the_same_size():
    s = ElasticSampler(20, 8, dp_rank=0, dp_size=2, micro_batch=2)
    next(iter(s))  # 1 of 2 micro-batches of the first global batch
    state = s.state_dict()
    same = ElasticSampler(20, 8, dp_rank=1, dp_size=2, micro_batch=2)
    same.load_state_dict(state)
    assert list(next(iter(same))) == same.order()[6:8]
    with pytest.raises(ValueError, match="inside a global batch"):
        ElasticSampler(20, 8, dp_size=4, dp_rank=0, micro_batch=2).load_state_dict(state)


@pytest.mark.parametrize("field,kw", [("num_samples", {"data": 21}), ("global_batch", {"global_batch": 4}),
                                      ("shuffle", {"shuffle": False}), ("drop_last", {"drop_last": True})])
def test_a_state_of_another_order_is_refused_naming_the_field(field, kw):
    state = ElasticSampler(20, 8).state_dict()
    args = {"data": 20, "global_batch": 8, **kw}
    with pytest.raises(ValueError, match=f"{field}="):
        ElasticSampler(args.pop("data"), args.pop("global_batch"), **args).load_state_dict(state)


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="not a multiple of 3"):
        ElasticSampler(10, 8, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="no full global batch"):
        ElasticSampler(5, 8, drop_last=True)
    with pytest.raises(ValueError, match="shuffle=False"):
        ElasticSampler(_Stream(10), 2)


class _Squares(Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


class _Stream(IterableDataset):
    """A stream that can seek; counts the samples it produced."""

    def __init__(self, n):
        self.n, self.read = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, position):
        for i in range(position, self.n):
            self.read += 1
            yield torch.tensor(i)


def test_the_loader_counts_delivered_batches_while_workers_prefetch():
    ds = _Squares()
    s = ElasticSampler(ds, 6, dp_rank=1, dp_size=2, micro_batch=1, seed=2)
    loader = ElasticLoader(ds, s, num_workers=2, prefetch_factor=4)
    got = []
    for b in loader:
        got.append(b[:, 0].tolist())
        if len(got) == 4:
            break
    state = loader.state_dict()
    assert (state["consumed"], state["micro_step"]) == (6, 1), state
    again = ElasticSampler(ds, 6, dp_rank=1, dp_size=2, micro_batch=1, seed=2)
    again.load_state_dict(state)
    order = again.order()
    assert got == [[order[3]], [order[4]], [order[5]], [order[9]]]
    assert [b[:, 0].tolist() for b in ElasticLoader(ds, again)][:2] == [[order[10]], [order[11]]]


def test_an_iterable_dataset_is_read_by_seeking_only_this_ranks_share():
    ds = _Stream(10)
    got = {}
    for r in range(2):
        s = ElasticSampler(ds, 4, dp_rank=r, dp_size=2, shuffle=False)
        got[r] = [b.tolist() for b in ElasticLoader(ds, s)]
    assert got == {0: [[0, 1], [4, 5], [8, 9]], 1: [[2, 3], [6, 7], [0, 1]]}  # the tail wraps to the start
    assert ds.read == 12  # each rank read its share, nothing else
    s = ElasticSampler(ds, 4, dp_rank=0, dp_size=1, shuffle=False)
    loader = ElasticLoader(ds, s)
    next(iter(loader))
    resumed = ElasticSampler(ds, 4, dp_rank=1, dp_size=4, shuffle=False)
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in ElasticLoader(ds, resumed)] == [[5], [9]]
    with pytest.raises(ValueError, match="num_workers=0"):
        ElasticLoader(ds, ElasticSampler(ds, 4, shuffle=False), num_workers=1)


def test_latest_checkpoint_is_the_newest_committed_one(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    for step in (5, 10, 15):
        save({"w": torch.full((2,), float(step))}, tmp_path / f"step-{step}", keep_last=2)
    (tmp_path / ".step-20.incomplete-deadbeef").mkdir()  # a save killed mid-write is never the latest
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-15")
    os.remove(tmp_path / "step-15" / "index.json")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-10")
    save({"w": torch.zeros(1)}, tmp_path / "other-1")
    with pytest.raises(CheckpointError, match="pass series="):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path, series="other-") == str(tmp_path / "other-1")


def _save_and_resume(rank, world_size, path, phase):
    import torch.distributed as dist

    from shardwise.composable import fully_shard
    from shardwise.mesh import init_mesh

    mesh = init_mesh(dp_shard=2 if world_size == 4 else 1, tp=2)  # dp 2 -> 1; tp peers read alike
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 4), mesh=mesh["dp_shard"])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ElasticSampler(50, 8, mesh=mesh, seed=7, micro_batch=2)
    seen = []
    try:
        ElasticSampler(50, 8, mesh=mesh["tp"])
        raise AssertionError("a mesh without a data-parallel axis was taken")
    except ValueError as e:
        assert "none of them is data-parallel" in str(e), e
    if phase == "save":
        for _ in range(3 * sampler.plan.accumulation):
            seen += next(iter(sampler))
        save_training_state(path, model, optim, step=3, data=sampler)
        return sampler.dp_rank, seen
    ts = load_training_state(path, model, optim, data=sampler)
    for _ in range(2 * sampler.plan.accumulation):
        seen += next(iter(sampler))
    dist.barrier()
    return sampler.dp_rank, seen, ts.data["consumed"], sampler.plan.accumulation


def test_the_position_saved_on_a_tp_mesh_resumes_at_another_size(tmp_path):
    path = str(tmp_path / "step-3")
    before = run_ranks(_save_and_resume, 4, path, "save")
    assert before[0] == before[1] and before[2] == before[3], "tp peers read the same samples"
    assert [r for r, _ in before] == [0, 0, 1, 1]
    after = run_ranks(_save_and_resume, 2, path, "resume")
    assert after[0] == after[1], "tp peers read the same samples"
    assert after[0][2:] == (24, 4), "3 global batches consumed; 4 micro-batches of 2 at dp size 1"
    order = ElasticSampler(50, 8, seed=7).order()
    union = before[0][1] + before[2][1] + after[0][1]
    assert sorted(union) == sorted(order[:40]), "5 global batches of 8, none repeated or skipped"
