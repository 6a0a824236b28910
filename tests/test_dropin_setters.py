"""Every ``FSDPModule`` setter takes effect whenever it is called: before the first step and
after it (once lazy init has run). Each scenario trains against a single-process reference
(2 micro-batches per step) and checks, during the step after the call, that the setting is
what the unit does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from shardwise.composable import fully_shard
from shardwise.composable._fsdp._state import get_state
from shardwise.composable._fsdp._common import ShardState
from tests._dist import run_ranks
from tests._models import Net, batches, loss_fn, make_mesh

TOL = 1e-6  # fp32, relative


def _g(module):
    return get_state(module).group


def _busy(module):
    g = _g(module)
    return g.is_unsharded or g.unshard_pending


class Scenario:
    """``act`` calls the setter; ``probe`` hooks record what the units do in the step after it."""

    mesh = (4,)

    def act(self, model):
        pass

    def micro(self, model, m, n):  # before micro-batch m of n, from the acting step on
        pass

    def install(self, model, rec):  # hooks for the acting step; return their handles
        return []

    def after_backward(self, model, rec, m):
        pass

    def before_step(self, model):
        pass


class RafInt(Scenario):
    def act(self, model):
        for b in model.blocks:
            b.set_reshard_after_forward(2)

    def install(self, model, rec):
        def probe(mod, args, out):
            rec.append(all(_g(b).state is ShardState.SHARDED_POST_FORWARD for b in model.blocks))
        return [model.head.register_forward_hook(probe)]


class RafFalse(Scenario):
    def act(self, model):
        for b in model.blocks:
            b.set_reshard_after_forward(False)

    def install(self, model, rec):
        return [model.head.register_forward_hook(lambda m, a, o: rec.append(all(_g(b).is_unsharded for b in model.blocks)))]


class RafRoot(Scenario):
    def act(self, model):
        model.set_reshard_after_forward(True, recurse=False)

    def install(self, model, rec):
        return [model.register_forward_hook(lambda m, a, o: rec.append(not _g(model).is_unsharded))]


class RabFalse(Scenario):
    def act(self, model):
        model.set_reshard_after_backward(False)

    def after_backward(self, model, rec, m):
        rec.append(all(_g(b).is_unsharded for b in model.blocks))

    def before_step(self, model):
        for b in (*model.blocks, model):
            b.reshard()  # the optimizer steps the sharded parameters


class GradSync(Scenario):
    def micro(self, model, m, n):
        model.set_requires_gradient_sync(m == n - 1)

    def after_backward(self, model, rec, m):
        if m == 0:  # accumulated unsharded, not reduced
            rec.append(all(p.grad is None for p in model.parameters()) and _g(model.blocks[0]).has_unsharded_grads())


class AllReduce(Scenario):
    mesh = (2, 2)

    def micro(self, model, m, n):
        model.set_requires_all_reduce(m == n - 1)

    def after_backward(self, model, rec, m):
        if m == 0:  # reduce-scattered, the replica all-reduce still owed
            rec.append(all(b.partial_over_replicas for b in _g(model.blocks[0]).buckets))


class FwdPrefetch(Scenario):
    def act(self, model):
        model.set_modules_to_forward_prefetch([model.blocks[1]])  # not the next unit: explicit

    def install(self, model, rec):
        return [model.emb.register_forward_pre_hook(
            lambda m, a: rec.append(_busy(model.blocks[1]) and not _busy(model.blocks[0])))]


class BwdPrefetch(Scenario):
    def act(self, model):
        model.set_modules_to_backward_prefetch([model.blocks[0]])

    def install(self, model, rec):
        return [model.head.register_full_backward_pre_hook(
            lambda m, g: rec.append(_busy(model.blocks[0]) and not _busy(model.blocks[1])))]


class UnshardLimit(Scenario):
    def __init__(self, limit):
        self.limit = limit

    def act(self, model):
        model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        model.set_unshard_limit(self.limit)

    def install(self, model, rec):
        # inside block 0's forward: with limit 1 block 1 was not prefetched, with 2 it was
        return [model.blocks[0].up.register_forward_hook(
            lambda m, a, o: rec.append(_busy(model.blocks[1]) == (self.limit > 1)))]


SCENARIOS = {
    "set_reshard_after_forward(2)": RafInt, "set_reshard_after_forward(False)": RafFalse,
    "set_reshard_after_forward(True) on the root": RafRoot, "set_reshard_after_backward(False)": RabFalse,
    "set_requires_gradient_sync": GradSync, "set_requires_all_reduce": AllReduce,
    "set_modules_to_forward_prefetch": FwdPrefetch, "set_modules_to_backward_prefetch": BwdPrefetch,
    "set_unshard_limit(1)": lambda: UnshardLimit(1), "set_unshard_limit(2)": lambda: UnshardLimit(2),
}


def _run(sc, rank, world, act_step, steps=3, micro=2):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = make_mesh(sc.mesh)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(steps * micro, 8)
    per, worst, rec = 8 // world, 0.0, []
    for step in range(steps):
        handles = []
        if step == act_step:
            sc.act(model)
            handles = sc.install(model, rec)
        for m in range(micro):
            tokens, target = data[step * micro + m]
            rl = loss_fn(ref(tokens), target)
            rl.backward()
            if step >= act_step:
                sc.micro(model, m, micro)
            sl = slice(rank * per, (rank + 1) * per)
            loss = loss_fn(model(tokens[sl]), target[sl])
            loss.backward()
            if step == act_step:
                sc.after_backward(model, rec, m)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            worst = max(worst, abs(mean.item() / world - rl.item()) / abs(rl.item()))
        for h in handles:
            h.remove()
        sc.before_step(model)
        ropt.step()
        opt.step()
        ropt.zero_grad()
        opt.zero_grad()
    want = dict(ref.named_parameters())
    perr = max(((p.full_tensor() - want[n]).abs().max() / want[n].abs().max()).item()
               for n, p in model.named_parameters())
    return worst, perr, rec


def _all(rank, world, act_step):
    """Every scenario in turn in the same rank processes."""
    return {name: _run(make(), rank, world, act_step) for name, make in SCENARIOS.items()}


@pytest.mark.parametrize("when", ["before the first step", "after the first step"])
def test_every_setter_takes_effect(when):
    act_step = 0 if when.startswith("before") else 1
    for rank, results in enumerate(run_ranks(_all, 4, act_step, timeout=180)):
        for name, (lerr, perr, rec) in results.items():
            assert rec and all(rec), f"rank {rank}: {name} called {when} did not take effect: {rec}"
            assert lerr <= TOL and perr <= TOL, f"rank {rank}: {name}: loss {lerr:.2e}, param {perr:.2e}"


def _limit_on_a_block(rank, world):
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=make_mesh((world,)))
    fully_shard(model, mesh=make_mesh((world,)))
    model.blocks[0].set_unshard_limit(1)
    try:
        model(torch.zeros(1, 5, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "no error"


def test_unshard_limit_on_a_non_root_unit_is_an_error():
    assert "call it on the root" in run_ranks(_limit_on_a_block, 2)[0]
