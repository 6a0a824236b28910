"""Overlap: prefetching all-gathers ahead of compute, reduce-scatters behind it, the unshard
limit, and HSDP accumulation without the replicate all-reduce. Shown by the order of events."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.composable import fully_shard
from shardwise.composable._fsdp._param_group import ParamGroup
from shardwise.composable._fsdp._state import get_state
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy


def _trace(model, steps, setup=None):
    """Run ``steps`` training steps; return the event log of the last one:
    ("issue", unit, async), ("compute", unit) at a unit's forward, ("reduce", unit)."""
    names = {id(get_state(m).group): n for n, m in
             [("root", model), ("b0", model.blocks[0]), ("b1", model.blocks[1])]}
    log = []
    real_unshard, real_reduce = ParamGroup.unshard, ParamGroup.reduce_grads

    def unshard(self, async_op=False):
        if not self.is_unsharded and not self.unshard_pending:
            log.append(("issue", names[id(self)], async_op))
        return real_unshard(self, async_op)

    def reduce_grads(self, **kw):
        log.append(("reduce", names[id(self)]))
        return real_reduce(self, **kw)

    for n, m in [("b0", model.blocks[0]), ("b1", model.blocks[1])]:
        m.register_forward_pre_hook(lambda mod, args, _n=n: log.append(("compute", _n)))
    ParamGroup.unshard, ParamGroup.reduce_grads = unshard, reduce_grads
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for tokens, target in batches(steps, 4):
            log.clear()
            loss_fn(model(tokens), target).backward()
            opt.step()
            opt.zero_grad()
    finally:
        ParamGroup.unshard, ParamGroup.reduce_grads = real_unshard, real_reduce
    return list(log)


def _prefetch(rank, world_size, mode):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mode == "limit1":
        model.set_unshard_limit(1)
    if mode == "explicit":
        model.set_modules_to_forward_prefetch([model.blocks[0], model.blocks[1]])
        model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    return _trace(model, steps=2)


def _index(log, event):
    assert event in log, f"{event} missing from {log}"
    return log.index(event)


def test_implicit_prefetch_overlaps_all_gathers_with_compute():
    log = run_ranks(_prefetch, 2, "implicit")[0]
    # forward: block 1's all-gather is issued (async) before block 0 computes
    assert _index(log, ("issue", "b1", True)) < _index(log, ("compute", "b0")), log
    # backward: block 0's all-gather is issued (async) before block 1's gradients are reduced
    backward = log[_index(log, ("compute", "b1")) + 1:]
    assert _index(backward, ("issue", "b0", True)) < _index(backward, ("reduce", "b1")), log
    assert [e for e in log if e[0] == "reduce"] == [("reduce", "b1"), ("reduce", "b0"), ("reduce", "root")]


def test_unshard_limit_bounds_the_units_alive():
    log = run_ranks(_prefetch, 2, "limit1")[0]
    # limit 1: a block is prefetched only while no other block is unsharded — here only block 0
    # from the root (which never reshards, so it is not counted); never block 1 during block 0,
    # never block 0 during block 1's backward
    assert [e for e in log if e[0] == "issue" and e[2]] == [("issue", "b0", True)], log


def test_explicit_prefetch():
    log = run_ranks(_prefetch, 2, "explicit")[0]
    # the root prefetches both blocks before any block computes
    first = _index(log, ("compute", "b0"))
    assert ("issue", "b0", True) in log[:first] and ("issue", "b1", True) in log[:first], log


def _hsdp_accumulate(rank, world_size):
    mesh = make_mesh((2, 2))
    ref, model = reference_and_copy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    (tokens, target), = batches(1, 8)
    loss_fn(ref(tokens), target).backward()
    counts = {"rs": 0, "ar": 0}
    real_rs, real_ar = dist.reduce_scatter_single, dist.all_reduce

    def rs(*a, **k):
        counts["rs"] += 1
        return real_rs(*a, **k)

    def ar(*a, **k):
        counts["ar"] += 1
        return real_ar(*a, **k)

    dist.reduce_scatter_single, dist.all_reduce = rs, ar
    seen = []
    try:
        for i, half in enumerate((slice(0, 1), slice(1, 2))):
            model.set_requires_all_reduce(i == 1)
            sl = slice(rank * 2, rank * 2 + 2)
            (loss_fn(model(tokens[sl][half]), target[sl][half]) / 2).backward()
            seen.append(dict(counts))
    finally:
        dist.reduce_scatter_single, dist.all_reduce = real_rs, real_ar
    ref_params = dict(ref.named_parameters())
    errs = {n: ((p.grad.full_tensor() - ref_params[n].grad).abs().max() / ref_params[n].grad.abs().max()).item()
            for n, p in model.named_parameters()}
    return seen, errs


def test_hsdp_accumulation_skips_the_replicate_all_reduce_until_the_last_micro_batch():
    for rank, (seen, errs) in enumerate(run_ranks(_hsdp_accumulate, 4)):
        assert seen[0] == {"rs": 3, "ar": 0}, f"rank {rank}: first micro-batch {seen[0]}"
        assert seen[1] == {"rs": 6, "ar": 3}, f"rank {rank}: after the last {seen[1]}"
        bad = {k: v for k, v in errs.items() if not v <= 1e-6}
        assert not bad, f"rank {rank}: {bad}"
