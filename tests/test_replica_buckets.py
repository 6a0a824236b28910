"""NO_SHARD (a (W, 1) mesh): the replica all-reduces of all units bucketed DDP-style, issued in
backward order, with buffers reused across steps only when no gradient still uses them
([Note: replica buckets] in composable/_fsdp/_bucket.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.composable import fully_shard
from shardwise.composable._fsdp import _bucket
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import batches, loss_fn, max_param_error, reference_and_copy
from tests.compat.test_setters import AllGathers

TOL = 1e-6


def _no_shard(model, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _buckets(rank, world_size, first_bytes, bytes_):
    _bucket.FIRST_BUCKET_BYTES, _bucket.BUCKET_BYTES = first_bytes, bytes_
    ref, model = reference_and_copy(n_blocks=3)
    _no_shard(model, world_size)
    ropt, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model))
    per = 8 // world_size
    counts, ptrs = [], []
    for tokens, target in batches(3, 8):
        loss_fn(ref(tokens), target).backward()
        mode = AllGathers()
        loss = loss_fn(model(tokens[rank * per:(rank + 1) * per]), target[rank * per:(rank + 1) * per])
        with mode:
            loss.backward()
        counts.append(mode.all_reduces)
        got, want = _grads(model), {n: p.grad for n, p in ref.named_parameters()}
        bad = {n: _rel(got[n], want[n]) for n in want if not _rel(got[n], want[n]) <= TOL}
        assert not bad, f"gradients differ from one process: {bad}"
        del got, want  # (full_tensor() on a shard axis of one rank may be a view: it would keep the buffer)
        ptrs.append(model.head.weight.grad.to_local().data_ptr())
        for o in (ropt, opt):
            o.step()
            o.zero_grad()
    errs = max_param_error(ref, model)
    assert maxerr(errs.values()) <= TOL, errs
    return counts, ptrs


def test_units_share_replica_all_reduces():
    """4 units (3 blocks + root) on a (2, 1) mesh: one all-reduce per bucket, not per unit —
    with the default sizes the whole (small) model is one bucket; with a first bucket of one
    byte, the first unit to finish backward goes alone and the rest together; with every
    bucket one byte, one per unit (the old behaviour). Gradients equal one process's each
    step, and with zero_grad() between steps the buffers are reused (same addresses)."""
    counts, ptrs = run_ranks(_buckets, 2, 1 << 20, 25 << 20)[0]
    assert counts == [1, 1, 1], counts
    assert len(set(ptrs)) == 1, f"the bucket buffer was not reused across steps: {ptrs}"
    assert run_ranks(_buckets, 2, 1, 25 << 20)[0][0] == [2, 2, 2]
    assert run_ranks(_buckets, 2, 1, 1)[0][0] == [4, 4, 4]


def _kept_gradients(rank, world_size):
    ref, model = reference_and_copy(n_blocks=2)
    _no_shard(model, world_size)
    per = 8 // world_size
    data = batches(3, 8)
    held = []
    for k, (tokens, target) in enumerate(data):
        loss_fn(ref(tokens), target).backward()
        loss_fn(model(tokens[rank * per:(rank + 1) * per]), target[rank * per:(rank + 1) * per]).backward()
        if k == 0:  # the user keeps the first step's gradients, then drops them from the parameters
            held = [(p.grad, p.grad.full_tensor()) for p in model.parameters()]
            model.zero_grad()
            ref_first = [p.grad.clone() for p in ref.parameters()]
            ref.zero_grad()
    # steps 2 and 3 accumulated (no zero_grad between them), as on one process
    got, want = _grads(model), {n: p.grad for n, p in ref.named_parameters()}
    bad = {n: _rel(got[n], want[n]) for n in want if not _rel(got[n], want[n]) <= TOL}
    assert not bad, f"accumulated gradients differ: {bad}"
    for (g, copy), r in zip(held, ref_first):
        assert isinstance(g, DTensor) and torch.equal(g.full_tensor(), copy), "a kept gradient was overwritten"
        assert _rel(copy, r) <= TOL
    dist.barrier()
    return True


def test_gradients_the_user_keeps_are_never_overwritten():
    """A gradient kept by the user after zero_grad(), and gradients accumulated over two
    backwards without zero_grad: the bucket buffer their storage is part of is not reused, so
    both stay right."""
    assert run_ranks(_kept_gradients, 2) == [True, True]
