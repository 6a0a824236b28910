"""Differential: every setter that both implementations' ``FSDPModule`` has, called before the
first step and after it. Each setter's effect is observed (the all-gathers that backward issues,
which modules hold unsharded parameters, gradient accumulation) and the training equals one
process's throughout.

The other methods of torch's FSDPModule are in `test_fsdp_module_api.py`; shardwise's
``set_unshard_limit`` has no torch counterpart."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests._dist import RankFailure, run_on_workers
from tests.compat._adapter import (
    IMPLS, assert_close, assert_losses, batches, build, dp_slice, full_params, impl, loss_of, shard,
)

TOL = 1e-6
WORLD = 4


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    return sum(_numel(y) for y in x) if isinstance(x, (list, tuple)) else 0


class AllGathers(TorchDispatchMode):
    """Records the group size of every all-gather (the c10d ops, whichever Python API issued
    them): elements of the output(s) / elements of the input(s); and counts all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.all_reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in func.__name__:
            self.sizes.append(round(_numel(args[0]) / max(1, _numel(args[1]))))
        self.all_reduces += "allreduce" in func.__name__
        return func(*args, **(kwargs or {}))


def _step(model, opt, tokens, rank, world_size, micro: int = 1, between=None, last=None) -> dict:
    """One optimizer step on this rank's slice in ``micro`` micro-batches; ``between(k)`` runs
    before micro-batch ``k``. Returns what was seen: loss, backward all-gather group sizes,
    whether block 0 held DTensor (sharded) parameters after forward and after backward."""
    rows = dp_slice(tokens, rank, world_size)
    per = rows.shape[0] // micro
    seen = {"gathers": [], "sharded_after_forward": [], "sharded_after_backward": [], "all_reduces": []}
    total = 0.0
    for k in range(micro):
        if between is not None:
            between(k)
        loss = loss_of(model, rows[k * per:(k + 1) * per]) / micro
        seen["sharded_after_forward"].append(isinstance(model.blocks[0].mlp.w1.weight, DTensor))
        mode = AllGathers()
        with mode:
            loss.backward()
        seen["gathers"].append(sorted(set(mode.sizes)))
        seen["all_reduces"].append(mode.all_reduces)
        seen["sharded_after_backward"].append(isinstance(model.blocks[0].mlp.w1.weight, DTensor))
        total += loss.item()
    opt.step()
    opt.zero_grad()
    t = torch.tensor([total])
    torch.distributed.all_reduce(t)
    seen["loss"] = t.item() / world_size
    return seen


def _ref_step(ref, ropt, tokens) -> float:
    loss = loss_of(ref, tokens)
    loss.backward()
    ropt.step()
    ropt.zero_grad()
    return loss.item()


def _setters(rank, world_size, name, when, hsdp=False):
    i = impl(name)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = shard(i, build(0), mesh)
    ref = build(0)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    data = batches(5, batch=8)
    blocks = list(model.blocks)
    got, want, log = [], [], {}

    def run(tokens, label, **kw):
        seen = _step(model, opt, tokens, rank, world_size, **kw)
        got.append(seen["loss"])
        want.append(_ref_step(ref, ropt, tokens))
        log[label] = seen
        return seen

    if when == "after":
        run(data.pop(0), "default")
    if hsdp:  # accumulate the reduce-scattered shards; one all-reduce across replicas at the end
        seen = run(data.pop(0), "requires_all_reduce", micro=2, between=lambda k: model.set_requires_all_reduce(k == 1))
        assert seen["all_reduces"][0] == 0 < seen["all_reduces"][1], f"{name} {when}: {seen}"
        assert_losses(got, want, TOL, f"{name} {when} HSDP")
        assert_close(full_params(model), full_params(ref), TOL, f"{name} {when} HSDP: parameters")
        return log
    # prefetch: block k's forward also gathers block k+1, its backward block k-1
    for k, b in enumerate(blocks):
        b.set_modules_to_forward_prefetch(blocks[k + 1:k + 2])
        b.set_modules_to_backward_prefetch(blocks[k - 1:k] if k else [])
    model.set_reshard_after_forward(False)
    seen = run(data.pop(0), "reshard_after_forward=False")
    assert seen["gathers"] == [[]] and seen["sharded_after_forward"] == [False], f"{name} {when}: {seen}"
    model.set_reshard_after_forward(True)
    seen = run(data.pop(0), "reshard_after_forward=True")
    assert seen["gathers"] == [[world_size]] and seen["sharded_after_forward"] == [True], f"{name} {when}: {seen}"

    def accumulate(k):  # no reduce-scatter and no reshard after backward until the last micro-batch
        model.set_requires_gradient_sync(k == 1)
        model.set_reshard_after_backward(k == 1)
    seen = run(data.pop(0), "accumulate", micro=2, between=accumulate)
    assert seen["sharded_after_backward"] == [False, True], f"{name} {when}: {seen}"
    assert_losses(got, want, TOL, f"{name} {when}")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} {when}: parameters")
    return log


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_setters_before_and_after_the_first_step(name, when):
    """Forward/backward prefetch, set_reshard_after_forward(False / True), gradient accumulation
    with set_requires_gradient_sync + set_reshard_after_backward: each one's effect is seen and
    the steps equal one process's."""
    run_on_workers(_setters, WORLD, name, when, timeout=120)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_set_requires_all_reduce(name, when):
    """HSDP (2 replicas x 2 shards) accumulation over 2 micro-batches: the first backward
    reduce-scatters without all-reducing across replicas, the second all-reduces."""
    run_on_workers(_setters, WORLD, name, when, True, timeout=120)


def _reshard_to_int(rank, world_size, name, when):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = shard(i, build(0), mesh)
    ref = build(0)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    got, want = [], []
    for k, tokens in enumerate(batches(2)):
        if (when == "before") == (k == 0):
            model.set_reshard_after_forward(2)  # keep 1/2 after forward, re-gather over 2 ranks
        seen = _step(model, opt, tokens, rank, world_size)
        got.append(seen["loss"])
        want.append(_ref_step(ref, ropt, tokens))
        if k == 1:
            assert seen["gathers"] == [[2]], f"{name} {when}: set_reshard_after_forward(2) not in effect: {seen}"
    assert_losses(got, want, TOL, f"{name} {when}")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} {when}: parameters")


TORCH_BOOL_ONLY = pytest.mark.xfail(strict=True, raises=RankFailure, reason=(
    "torch 2.13 FSDPModule.set_reshard_after_forward accepts only a bool (ValueError for an int); "
    "an int is accepted only by fully_shard itself"))


@pytest.mark.parametrize("name", [pytest.param("torch", marks=TORCH_BOOL_ONLY), "shardwise"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_set_reshard_after_forward_int(name, when):
    """set_reshard_after_forward(2) on 4 ranks before (or after) the first step: the next
    backward re-gathers over groups of 2."""
    run_on_workers(_reshard_to_int, WORLD, name, when, timeout=90)
