"""fully_shard training features against single-process references: mixed precision, CPU
offload, frozen / mixed-dtype / tied parameters, module reuse, branches, activation
checkpointing, eval, forward methods."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from shardwise.composable import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import Net, batches, loss_fn, make_mesh, max_param_error, reference_and_copy, train_pair

TOL = 1e-6


def _shard(model, mesh, **kw):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _check(results):
    for rank, (loss_err, errs) in enumerate(results):
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ: {bad}"


# -- mixed precision ----------------------------------------------------------------------------
def _mixed_precision(rank, world_size, mesh_shape):
    mesh = make_mesh(mesh_shape)
    ref, model = reference_and_copy()
    block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=block_policy)
    # output_dtype applies to a unit's own outputs: set it on the root only
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = 8 // world_size
    worst = 0.0
    for tokens, target in batches(3, 8):
        # reference: each rank's slice in bf16 compute, bf16 grads summed in fp32, averaged
        low = copy.deepcopy(ref).to(torch.bfloat16)
        ref_losses = []
        sums = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world_size):
            sl = slice(r * per, (r + 1) * per)
            loss = loss_fn(low(tokens[sl]).float(), target[sl])
            loss.backward()
            ref_losses.append(loss.item())
            for acc, q in zip(sums, low.parameters()):
                acc += q.grad.float()  # each rank's bf16 gradient, summed in fp32
                q.grad = None
        for p, acc in zip(ref.parameters(), sums):
            p.grad = acc / world_size
        ropt.step()
        ropt.zero_grad()
        sl = slice(rank * per, (rank + 1) * per)
        out = model(tokens[sl])
        assert out.dtype == torch.float32, f"output_dtype: {out.dtype}"
        loss = loss_fn(out, target[sl])
        loss.backward()
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, f"{n}: master/grad stay fp32"
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_mean = sum(ref_losses) / world_size
        worst = maxerr(worst, abs(mean.item() / world_size - ref_mean) / ref_mean)
    return worst, max_param_error(ref, model)


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (2, 2))])
def test_mixed_precision_matches_a_reference_that_casts_the_same_way(world_size, mesh_shape):
    _check(run_ranks(_mixed_precision, world_size, mesh_shape))


def _mixed_precision_collectives(rank, world_size):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    _shard(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    seen = []
    real_ag, real_rs = dist.all_gather_single, dist.reduce_scatter_single
    dist.all_gather_single = lambda out, inp, **k: (seen.append(("ag", out.numel())), real_ag(out, inp, **k))[1]
    dist.reduce_scatter_single = lambda out, inp, **k: (seen.append(("rs", inp.dtype)), real_rs(out, inp, **k))[1]
    try:
        model(torch.randint(0, 11, (2, 5))).float().sum().backward()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real_ag, real_rs
    n_fp32 = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in model.parameters(recurse=False))
    n_fp32 += sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0])
                  for m in (model.emb, model.head) for p in m.parameters())
    return seen, n_fp32 * world_size * 2


def test_mixed_precision_gathers_half_the_bytes_and_reduces_in_reduce_dtype():
    seen, root_bytes = run_ranks(_mixed_precision_collectives, 2)[0]
    assert seen[0] == ("ag", root_bytes), f"root all-gather carries bf16 bytes: {seen[0]} vs {root_bytes}"
    assert {e[1] for e in seen if e[0] == "rs"} == {torch.bfloat16}


def _buffer_dtype(rank, world_size):
    m = nn.BatchNorm1d(4)
    fully_shard(m, mesh=make_mesh((world_size,)), mp_policy=MixedPrecisionPolicy(buffer_dtype=torch.float64))
    return str(m.running_mean.dtype), str(m.num_batches_tracked.dtype)


def test_buffer_dtype_casts_floating_buffers_only():
    assert run_ranks(_buffer_dtype, 1) == [("torch.float64", "torch.int64")]


# -- CPU offload ---------------------------------------------------------------------------------
def _offload(rank, world_size):
    mesh = make_mesh((world_size,))
    ref, model = reference_and_copy()
    _shard(model, mesh, offload_policy=CPUOffloadPolicy())
    for n, p in model.named_parameters():
        assert p.to_local().device.type == "cpu", n
        assert not p.to_local().is_pinned(), f"{n}: no accelerator here, so no pinned memory"
    return train_pair(ref, model, rank, world_size), max_param_error(ref, model)


def test_cpu_offload_on_a_cpu_only_host():
    _check(run_ranks(_offload, 2))


# -- frozen, mixed dtypes, tied --------------------------------------------------------------------
def _frozen_and_mixed_dtypes(rank, world_size):
    mesh = make_mesh((world_size,))
    ref, model = reference_and_copy()
    for m in (ref, model):
        m.emb.weight.requires_grad_(False)
        m.blocks[0].up.weight.requires_grad_(False)
        m.scale = nn.Parameter(m.scale.detach().double())  # fp64 next to fp32 in the root unit
    _shard(model, mesh)
    assert model.scale.dtype == torch.float64 and model.head.weight.dtype == torch.float32, \
        f"sharding changed dtypes: scale {model.scale.dtype}, head.weight {model.head.weight.dtype}"
    assert not model.emb.weight.requires_grad and not model.blocks[0].up.weight.requires_grad, \
        "sharding made frozen parameters trainable"
    loss_err = train_pair(ref, model, rank, world_size)
    assert model.emb.weight.grad is None and model.blocks[0].up.weight.grad is None, "frozen: no grad"
    return loss_err, max_param_error(ref, model)


def test_frozen_parameters_and_mixed_dtypes_in_one_unit():
    _check(run_ranks(_frozen_and_mixed_dtypes, 2))


def _tied(rank, world_size):
    mesh = make_mesh((world_size,))
    ref, model = reference_and_copy(out=11)
    for m in (ref, model):
        m.head.weight = m.emb.weight
    _shard(model, mesh)
    assert model.head.weight is model.emb.weight, "the tie survives sharding"
    loss_err = train_pair(ref, model, rank, world_size, out=11)
    return loss_err, max_param_error(ref, model)


def test_tied_embedding_and_head_in_one_unit():
    _check(run_ranks(_tied, 2))


# -- dynamic graphs ----------------------------------------------------------------------------------
class ReuseNet(Net):
    """Runs block 0 twice; skips block 1 on every other call (same on all ranks)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def forward(self, tokens):
        self.calls += 1
        x = self.blocks[0](self.blocks[0](self.emb(tokens)))
        if self.calls % 2 == 0:
            x = self.blocks[1](x)
        return self.head(x) * self.scale.sum()


class CheckpointNet(Net):
    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x) * self.scale.sum()


def _dynamic(rank, world_size, cls_name, raf):
    cls = {"reuse": ReuseNet, "checkpoint": CheckpointNet}[cls_name]
    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    _shard(model, make_mesh((world_size,)), reshard_after_forward=raf)
    loss_err = train_pair(ref, model, rank, world_size, steps=4)
    return loss_err, max_param_error(ref, model)


@pytest.mark.parametrize("cls_name", ["reuse", "checkpoint"])
@pytest.mark.parametrize("raf", [True, False])
def test_module_reuse_branches_and_activation_checkpointing(cls_name, raf):
    _check(run_ranks(_dynamic, 2, cls_name, raf))


# -- eval and forward methods ------------------------------------------------------------------------
def _eval_frees(rank, world_size):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    _shard(model, mesh)
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 11, (2, 5)))
    from shardwise.composable._fsdp._state import get_state

    allocated = [p.fqn for m in model.modules() if get_state(m) is not None
                 for p in get_state(m).group.params if p.unsharded_allocated]
    assert not allocated, f"unsharded storage kept after a no_grad forward: {allocated}"
    return all(isinstance(p, DTensor) for p in model.parameters())


def test_eval_forward_under_no_grad_reshards_everything():
    assert run_ranks(_eval_frees, 2) == [True, True]


class GenNet(Net):
    def generate(self, tokens):
        return (self.head(self.emb(tokens)) * self.scale.sum()).argmax(-1)


def _forward_method(rank, world_size):
    torch.manual_seed(0)
    ref = GenNet()
    model = copy.deepcopy(ref)
    _shard(model, make_mesh((world_size,)))
    register_fsdp_forward_method(model, "generate")
    tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.generate(tokens)
    return torch.equal(got, ref.generate(tokens)) and isinstance(model.head.weight, DTensor)


def test_register_fsdp_forward_method():
    assert run_ranks(_forward_method, 2) == [True, True]


def _forward_without_backward(rank, world_size):
    """A forward with grad enabled whose output is dropped (e.g. logging) must not delay the
    next step's reduce-scatters to the end of backward."""
    mesh = make_mesh((world_size,))
    ref, model = reference_and_copy()
    _shard(model, mesh)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))
    model(tokens)  # output dropped: no backward for this forward
    from shardwise.composable._fsdp._state import get_state

    fired_early, in_final = [], []
    root, block = get_state(model), get_state(model.blocks[1])
    real_reduce, real_final = block.reduce, root.ctx.final_callback

    def reduce():
        fired_early.append(not in_final)
        return real_reduce()

    def final():
        in_final.append(1)
        return real_final()

    block.reduce, root.ctx.final_callback = reduce, final
    model(tokens).sum().backward()
    return fired_early


def test_a_forward_without_backward_does_not_stall_the_next_backward():
    for rank, fired in enumerate(run_ranks(_forward_without_backward, 2)):
        assert fired and fired[0], f"rank {rank}: block 1 reduced inside backward, not at its end: {fired}"


def _params_freed_before_reduce(rank, world_size, raf):
    """When a unit's reduce-scatter allocates its send buffer, the unit's unsharded
    parameters are already freed (so the buffer, the gradients and the parameters never
    coexist) — in the post-backward hook and in the final callback (the root)."""
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    _shard(model, mesh, reshard_after_forward=raf)
    from shardwise.composable._fsdp._state import get_state

    seen = {}
    for m in model.modules():
        st = get_state(m)
        if st is None:
            continue
        real = st.group.reduce_grads

        def reduce_grads(*a, _g=st.group, _real=real, _name=type(m).__name__ + str(id(m) % 997), **kw):
            seen[_name] = [p.fqn for p in _g.params if p.unsharded_allocated]
            return _real(*a, **kw)

        st.group.reduce_grads = reduce_grads
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))
    model(tokens).pow(2).mean().backward()
    return len(seen), {k: v for k, v in seen.items() if v}


@pytest.mark.parametrize("raf", [True, False])
def test_unsharded_parameters_are_freed_before_the_reduce_scatter(raf):
    for rank, (units, kept) in enumerate(run_ranks(_params_freed_before_reduce, 2, raf)):
        assert units == 3, f"rank {rank}: expected 3 units to reduce, saw {units}"
        assert not kept, f"rank {rank}: unsharded parameters still allocated at reduce time: {kept}"
