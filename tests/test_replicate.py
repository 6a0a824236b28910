"""`replicate` (composable/_replicate/): plain parameters, bucketed all-reduces in backward,
DDP's numbers; and the NO_SHARD strategy that uses it. Against one process, on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardwise.composable import (MixedPrecisionPolicy, ReplicateModule, ShardingPolicy, apply_fully_shard,
                                  fully_shard, replicate)
from tests._dist import run_ranks
from tests._models import batches, loss_fn, max_param_error, reference_and_copy, train_pair
from tests.compat.test_setters import AllGathers

TOL = 1e-6


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def _train(rank, world_size, cap_mb):
    ref, model = reference_and_copy(n_blocks=3)
    replicate(model, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb)
    plain = all(type(p) is nn.Parameter and not isinstance(p, DTensor) for p in model.parameters())
    mode = AllGathers()
    with mode:
        worst = train_pair(ref, model, rank, world_size, steps=3)
    return worst, max(max_param_error(ref, model).values()), plain, mode.all_reduces, isinstance(model, ReplicateModule)


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicate_trains_like_one_process(world_size):
    """AdamW, 3 steps, each rank its slice of the batch: losses and parameters equal one
    process's (fp32, 1e-6); parameters stay plain; the default caps put the whole small model
    in one bucket (1 all-reduce per step, plus train_pair's one loss all-reduce), a 1-byte cap
    one bucket per parameter."""
    for worst, err, plain, reduces, mixed in run_ranks(_train, world_size, 25.0):
        assert worst <= TOL and err <= TOL, (worst, err)
        assert plain and mixed
        assert reduces == 3 * 2, reduces
    n_params = len(list(reference_and_copy(n_blocks=3)[1].parameters()))
    for worst, err, _, reduces, _ in run_ranks(_train, 2, 1e-9):
        assert worst <= TOL and err <= TOL
        assert reduces == 3 * (n_params + 1), reduces


def _unused(rank, world_size, skip_on, zeros):
    """The head is skipped on the ranks in ``skip_on`` (and in the reference when all skip)."""
    torch.manual_seed(0)
    ref, model = reference_and_copy(n_blocks=2)
    replicate(model, first_bucket_cap_mb=1e-9, bucket_cap_mb=1e-9)  # many buckets: order matters
    if zeros:
        model.set_reduce_scatter_unused_params(True)
    tokens, target = batches(1, 8)[0]

    def run(m, skip, x):
        h = m.emb(x)
        for b in m.blocks:
            h = b(h)
        return h.sum(-1, keepdim=True).expand(*h.shape[:2], 3) if skip else m.head(h)

    loss_fn(run(model, rank in skip_on, _rows(tokens, rank, world_size)), _rows(target, rank, world_size)).backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def test_unused_parameters_keep_grad_none():
    """No rank used the head: its .grad stays None on every rank (zeros with
    set_reduce_scatter_unused_params(True)); one rank used it: every rank gets the same
    gradient (its sum divided by the world, DDP's mean), and the collectives still match."""
    for grads in run_ranks(_unused, 2, {0, 1}, False):
        assert grads["head.weight"] is None and grads["head.bias"] is None
        assert grads["emb.weight"] is not None
    for grads in run_ranks(_unused, 2, {0, 1}, True):
        assert torch.count_nonzero(grads["head.weight"]) == 0
    g0, g1 = run_ranks(_unused, 2, {1}, False)
    assert g0["head.weight"] is not None and torch.equal(g0["head.weight"], g1["head.weight"])
    assert torch.count_nonzero(g0["head.weight"]) > 0


def _accumulate(rank, world_size):
    ref, model = reference_and_copy(n_blocks=2)
    replicate(model)
    (t1, y1), (t2, y2) = batches(2, 8)
    for t, y in ((t1, y1), (t2, y2)):
        (loss_fn(ref(t), y) / 2).backward()
    mode = AllGathers()
    with mode:
        model.set_requires_gradient_sync(False)
        (loss_fn(model(_rows(t1, rank, world_size)), _rows(y1, rank, world_size)) / 2).backward()
        model.set_requires_gradient_sync(True)
        (loss_fn(model(_rows(t2, rank, world_size)), _rows(y2, rank, world_size)) / 2).backward()
    ref_g = dict(ref.named_parameters())
    err = max(((p.grad - ref_g[n].grad).abs().max() / ref_g[n].grad.abs().max()).item()
              for n, p in model.named_parameters())
    return err, mode.all_reduces


def test_gradient_accumulation_without_sync():
    """Two micro-batches, the first with sync off: one all-reduce in all, and the gradients
    equal one process's over both micro-batches."""
    for err, reduces in run_ranks(_accumulate, 2):
        assert err <= TOL and reduces == 1, (err, reduces)


def _broadcast(rank, world_size):
    torch.manual_seed(rank)  # different values on every rank
    m = nn.Linear(3, 2)
    replicate(m)
    got = torch.cat([m.weight.detach().flatten(), m.bias.detach()])
    out = [torch.empty_like(got) for _ in range(world_size)]
    dist.all_gather(out, got)
    return all(torch.equal(o, out[0]) for o in out)


def test_module_states_broadcast_from_first_rank():
    assert all(run_ranks(_broadcast, 2))


def _refusals(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, fn in {
        "meta": lambda: replicate(nn.Linear(2, 2, device="meta")),
        "twice": lambda: replicate(replicate(nn.Linear(2, 2))),
        "hsdp-mesh": lambda: replicate(nn.Linear(2, 2), init_device_mesh("cpu", (1, 2))),
        "fsdp-units": lambda: replicate(fully_shard(nn.Sequential(nn.Linear(2, 2)))),
    }.items():
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = str(e)
    return out


def test_bad_input_is_refused_on_every_rank():
    for out in run_ranks(_refusals, 2):
        assert "materialize" in out["meta"], out
        assert "replicated already" in out["twice"], out
        assert "fully_shard for HSDP" in out["hsdp-mesh"], out
        assert "fully_shard units" in out["fsdp-units"], out


def _strategy(rank, world_size, mp):
    ref, model = reference_and_copy(n_blocks=2)
    policy = ShardingPolicy(strategy="NO_SHARD", layer_cls="Block",
                            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy())
    apply_fully_shard(model, None, policy)
    kinds = {type(p).__name__ if not isinstance(p, DTensor) else "DTensor" for p in model.parameters()}
    worst = train_pair(ref, model, rank, world_size, steps=2) if not mp else None
    return kinds, worst, isinstance(model, ReplicateModule)


def test_no_shard_strategy_uses_replicate_unless_a_cast_is_asked():
    """apply_fully_shard(NO_SHARD): plain parameters through replicate (trains like one
    process); with a param_dtype cast, fully_shard on the (D, 1) mesh (DTensors), as before."""
    for kinds, worst, rep in run_ranks(_strategy, 2, False):
        assert kinds == {"Parameter"} and rep and worst <= TOL, (kinds, worst)
    for kinds, _, rep in run_ranks(_strategy, 2, True):
        assert kinds == {"DTensor"} and not rep, kinds


def _checkpoint(rank, world_size, path):
    from shardwise.checkpoint import get_model_state_dict, load, save

    ref, model = reference_and_copy(n_blocks=2)
    replicate(model)
    train_pair(ref, model, rank, world_size, steps=1)
    save({"model": get_model_state_dict(model)}, path)
    torch.manual_seed(5)
    other = reference_and_copy(seed=5, n_blocks=2)[1]
    state = {"model": get_model_state_dict(other)}
    load(state, path)
    return all(torch.equal(a, b) for a, b in zip(state["model"].values(), get_model_state_dict(model).values()))


def test_checkpoint_round_trip(tmp_path):
    assert all(run_ranks(_checkpoint, 2, str(tmp_path / "ck")))



def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        replicate(nn.Linear(2, 2))


def _divide(rank, world_size, factor):
    ref, model = reference_and_copy(n_blocks=2)
    replicate(model)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    tokens, target = batches(1, 8)[0]
    loss_fn(ref(tokens), target).backward()
    loss_fn(model(_rows(tokens, rank, world_size)), _rows(target, rank, world_size)).backward()
    scale = world_size / (factor or world_size)  # the rank losses' sum over ranks / factor
    ref_g = dict(ref.named_parameters())
    return max(((p.grad - scale * ref_g[n].grad).abs().max() / ref_g[n].grad.abs().max()).item()
               for n, p in model.named_parameters())


@pytest.mark.parametrize("factor", [None, 1.0, 8.0])
def test_gradient_divide_factor(factor):
    """Default: the mean over ranks (one process's gradient); set_gradient_divide_factor(f):
    the sum over ranks divided by f."""
    assert max(run_ranks(_divide, 2, factor)) <= TOL


def _reuse(rank, world_size):
    ref, model = reference_and_copy(n_blocks=2)
    replicate(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ptrs, kept_ok = [], True
    held = None
    for k, (tokens, target) in enumerate(batches(4, 8)):
        loss_fn(model(_rows(tokens, rank, world_size)), _rows(target, rank, world_size)).backward()
        ptrs.append(model.head.weight.grad.data_ptr())
        if k == 2:  # keep this step's gradient: the next backward must not write over it
            held = (model.head.weight.grad, model.head.weight.grad.clone())
        opt.step()
        opt.zero_grad()
    kept_ok = torch.equal(held[0], held[1])
    return ptrs, kept_ok


def test_bucket_buffers_are_reused_unless_a_gradient_is_kept():
    """After zero_grad() the next backward writes into the same buffers (no new allocation per
    step); a gradient the user holds is never overwritten (that step gets a new buffer)."""
    for ptrs, kept_ok in run_ranks(_reuse, 2):
        assert ptrs[0] == ptrs[1] == ptrs[2], ptrs
        assert ptrs[3] != ptrs[2] and kept_ok, ptrs
