"""Differential: LoRA with PEFT (``get_peft_model``, then ``fully_shard`` per decoder layer and the
PEFT model as the root, so each unit holds frozen base weights and trainable adapters) on
torch's FSDP2 and on shardwise, both against the same PEFT model in one process, 2 gloo ranks,
fp32: the losses of three AdamW steps, gradients only for the adapters (and equal to one
process's), reduce-scatters only of the adapters' gradients (no gradient buffer for a frozen
weight: with every parameter put in the reduction buckets this fails, 4732 elements sent per
step for 768 trainable), optimizer state only for the adapters, the frozen base weights sharded and left
bit-exact, the adapters' values after the steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests._compare import rel_errs
from tests._dist import run_on_workers
from tests._lora import LR, batch, peft_model, rel_err, shard
from tests.compat._adapter import IMPLS, impl
from tests.compat._rebind import assert_ran

WORLD = 2
TOL = 1e-6  # fp32: losses and first-step gradients, sums of two half-batches against one whole batch
# adapters after 3 AdamW steps: AdamW divides by sqrt(v), which enlarges the ~1e-7 differences of
# summing half-batches where a gradient element is near 0 (tests/test_hf_clients.py, PARAM_TOL)
PARAM_TOL = 2e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


_SENT: list[int] = []  # input elements of each reduce-scatter since the spies went in (per worker)


def _count_reduce_scatters() -> list[int]:
    """Spy on c10d's reduce-scatters (torch's FSDP2 calls ``reduce_scatter_tensor``, shardwise
    ``reduce_scatter_single``), once per worker process: the input elements of each call are
    appended to the list returned (emptied here)."""
    for fn_name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        fn = getattr(dist, fn_name, None)
        if fn is None or getattr(fn, "_lora_spy", False):
            continue

        def spy(output, input, *a, _fn=fn, **kw):
            _SENT.append(input.numel())
            return _fn(output, input, *a, **kw)

        spy._lora_spy = True
        setattr(dist, fn_name, spy)
    _SENT.clear()
    return _SENT


def _lora_steps(rank, world_size, name):
    i = impl(name)
    ref, model = peft_model(0), peft_model(0)
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    frozen0 = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), f"{name}: trainable {sorted(trainable)}"
    shard(model, i.fully_shard, init_device_mesh("cpu", (world_size,)))
    assert_ran(name, model)  # in the rank: PEFT's model sharded by `name`'s units
    for n, p in model.named_parameters():  # every parameter sharded, frozen ones included
        assert isinstance(p, DTensor) and p.requires_grad == (n in trainable), f"{name}: {n} {type(p)}"
    # the usual PEFT loop hands the optimizer every parameter: the frozen ones never get a gradient
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, ref))
    per = 4 // world_size
    losses = []
    sent = _count_reduce_scatters()
    n_trainable = sum(p.numel() for n, p in ref.named_parameters() if n in trainable)
    for step in range(3):
        want = ref(**batch(step)).loss
        want.backward()
        loss = model(**batch(step, slice(rank * per, (rank + 1) * per))).loss
        loss.backward()
        # gradients are reduced for the adapters alone: no reduce-scatter buffer holds a frozen
        # weight (a unit's padding and shardwise's used flags, a few elements per parameter, aside)
        assert 0 < sum(sent) <= 2 * n_trainable, \
            f"{name} step {step}: {sum(sent)} elements reduce-scattered for {n_trainable} trainable ones"
        sent.clear()
        has_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        assert has_grad == trainable, f"{name} step {step}: gradients for {sorted(has_grad ^ trainable)}"
        if step == 0:
            rgrads = dict((n, p.grad) for n, p in ref.named_parameters())
            bad = {n: e for n, p in model.named_parameters() if p.grad is not None
                   and not (e := rel_err(_full(p.grad), rgrads[n])) <= TOL}
            assert not bad, f"{name}: first-step gradients off by {bad}"
        opt.step(), ropt.step()
        opt.zero_grad(), ropt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        assert abs(mean.item() - want.item()) <= TOL * abs(want.item()), f"{name} step {step}: {mean} vs {want}"
        losses.append(mean.item())
    state_of = {n for n, p in model.named_parameters() if opt.state.get(p)}
    assert state_of == trainable, f"{name}: optimizer state for {sorted(state_of ^ trainable)}"
    got = {n: _full(p) for n, p in model.named_parameters()}
    changed = [n for n, v in frozen0.items() if not torch.equal(got[n], v)]
    assert not changed, f"{name}: frozen parameters changed: {changed}"
    rparams = dict(ref.named_parameters())
    bad = {n: e for n in trainable if not (e := rel_err(got[n], rparams[n].detach())) <= PARAM_TOL}
    assert not bad, f"{name}: adapters after 3 AdamW steps off by {bad}"
    frozen_local = sum(p.to_local().numel() for n, p in model.named_parameters() if n not in trainable)
    return losses, {n: got[n] for n in sorted(trainable)}, frozen_local, sum(v.numel() for v in frozen0.values())


@pytest.fixture(scope="module")
def runs():
    return {name: run_on_workers(_lora_steps, WORLD, name, timeout=180) for name in IMPLS}


@pytest.mark.parametrize("name", IMPLS)
def test_lora_fine_tune_matches_one_process(runs, name):
    (losses, _, local, total), other = runs[name]
    assert other[0] == losses, f"{name}: ranks report different losses"
    # the frozen base is sharded: this rank holds about half of it (dims split by torch.chunk)
    assert local <= total // WORLD + 64, f"{name}: rank 0 holds {local} of {total} frozen elements"


def test_shardwise_equals_torch(runs):
    (tl, tp, _, _), _ = runs["torch"]
    (sl, sp, _, _), _ = runs["shardwise"]
    assert rel_errs(sl, tl) <= TOL, (sl, tl)
    bad = {n: e for n in tp if not (e := rel_err(sp[n], tp[n])) <= PARAM_TOL}
    assert sp.keys() == tp.keys() and not bad, bad
