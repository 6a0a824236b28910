"""Differential: FSDPModule's reduction, collective and recovery methods, and the module-level
functions, on torch's FSDP2 and on shardwise, each against one process.

Every case checks an effect that a wrong implementation would miss: gradients compared directly
with the one-process gradients (a wrong scale or a skipped hook is off by a factor), collectives
counted, the group a custom collective was handed, parameters sharded again after a reset.
(`test_setters.py` covers the schedule setters: prefetch, reshard, gradient sync.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests._dist import RankFailure, run_on_workers
from tests.compat._adapter import (
    IMPLS, assert_close, assert_losses, batches, build, dp_slice, full_params, impl, loss_of, shard,
)

TOL = 1e-6
WORLD = 4


def _mesh(world_size: int, hsdp: bool):
    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def _units(model) -> list:
    return [model, *model.blocks]


def _module_fns(name: str):
    """(share_comm_ctx, register_fsdp_forward_method) of the implementation."""
    if name == "torch":
        from torch.distributed.fsdp import register_fsdp_forward_method, share_comm_ctx
    else:
        from shardwise.composable import register_fsdp_forward_method, share_comm_ctx
    return share_comm_ctx, register_fsdp_forward_method


def _grads_after_backward(model, ref, tokens, rank, world_size):
    """One backward of each (this rank's slice / the whole batch): (sharded grads, one-process grads)."""
    loss_of(ref, tokens).backward()
    loss_of(model, dp_slice(tokens, rank, world_size)).backward()
    return full_params(model, grads=True), full_params(ref, grads=True)


# -- gradient scale: divide factor, force-sum, the reduction hook ---------------------------------
def _divide_and_hook(rank, world_size, name, hsdp, force_sum, factor, deprecated_name=False):
    i = impl(name)
    model = shard(i, build(0), _mesh(world_size, hsdp))
    ref = build(0)
    seen = []  # (norm of the hook's tensor, unit index)

    def hook_of(k):
        def hook(t):
            seen.append((t.double().norm().item(), k))
            t.mul_(3.0)
        return hook

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, u in enumerate(_units(model)):
            if deprecated_name:
                u.set_reduce_scatter_divide_factor(factor)
            elif factor is not None:
                u.set_gradient_divide_factor(factor)
            u.set_force_sum_reduction_for_comms(force_sum)
            u.set_all_reduce_hook(hook_of(k))
    if deprecated_name:
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), f"{name}: no DeprecationWarning"
    got, want = _grads_after_backward(model, ref, batches(1, batch=8)[0], rank, world_size)
    # sum over the 4 ranks of their slice means = 4 x the global mean; / factor; x 3 by the hook
    divisor = world_size if factor is None else factor
    assert_close(got, {k: v * (world_size / divisor) * 3.0 for k, v in want.items()}, TOL, f"{name}: gradients")
    assert sorted(k for _, k in seen) == list(range(len(_units(model)))), f"{name}: hook calls {seen}"
    # the hook saw this rank's reduced shards: sums with force-sum, else divided (x 1/3: before it)
    local = {k: 0.0 for k in range(len(_units(model)))}
    owners = {id(p): k for k, u in enumerate(_units(model)) for p in u.parameters()}
    for p in model.parameters():
        local[owners[id(p)]] += p.grad.to_local().double().pow(2).sum().item()
    for norm, k in seen:
        expect = local[k] ** 0.5 / 3.0 * (divisor if force_sum else 1.0)
        assert abs(norm - expect) <= 1e-5 * expect, f"{name} unit {k}: hook saw norm {norm}, expected {expect}"
    if hsdp:  # FSDP2: no hook stream with native HSDP
        try:
            model.set_all_reduce_hook(lambda t: None, stream=object())
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: a hook stream on HSDP was accepted")


TORCH_PREMUL_SUM = pytest.mark.xfail(strict=True, raises=RankFailure, reason=(
    "torch 2.13 FSDP2 reduces with ReduceOp.PREMUL_SUM(1/factor) when a divide factor is set without "
    "force-sum: 'Cannot use ReduceOp.PREMUL_SUM with Gloo'; shardwise sums and divides after"))


def _cases():
    for hsdp in (False, True):
        for force_sum in (False, True):
            for factor in (None, 2.0):
                for name in IMPLS:
                    # (HSDP on 2 x 2: a factor of 2 equals the shard size, for which FSDP2 takes AVG)
                    marks = [TORCH_PREMUL_SUM] if name == "torch" and factor and not force_sum and not hsdp else []
                    ids = f"{name}-{'hsdp' if hsdp else 'fsdp'}-{'force_sum' if force_sum else 'avg'}-f{factor}"
                    yield pytest.param(name, hsdp, force_sum, factor, marks=marks, id=ids)


@pytest.mark.parametrize("name,hsdp,force_sum,factor", list(_cases()))
def test_gradient_divide_factor_and_all_reduce_hook(name, hsdp, force_sum, factor):
    """set_gradient_divide_factor(2) on 4 data-parallel ranks doubles the gradients; a hook that
    scales by 3 triples them; the hook sees divided gradients, or sums with
    set_force_sum_reduction_for_comms(True); once per unit per backward."""
    run_on_workers(_divide_and_hook, WORLD, name, hsdp, force_sum, factor, timeout=90)


@pytest.mark.parametrize("name", IMPLS)
def test_set_reduce_scatter_divide_factor_is_deprecated(name):
    """The old name warns (DeprecationWarning) and acts as set_gradient_divide_factor."""
    run_on_workers(_divide_and_hook, WORLD, name, False, True, 2.0, True, timeout=90)


# -- custom collectives, separate reduce-scatter group --------------------------------------------
class _Recorded:
    """A custom all-gather / reduce-scatter (both protocols, duck-typed) that records the groups."""

    def __init__(self, log: list, kind: str) -> None:
        self.log, self.kind = log, kind

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.log.append((self.kind, group))
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms(rank, world_size, name, separate):
    i = impl(name)
    model = shard(i, build(0), _mesh(world_size, False))
    ref = build(0)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    log = []
    for u in _units(model):
        u.set_custom_all_gather(_Recorded(log, "all_gather"))
        u.set_custom_reduce_scatter(_Recorded(log, "reduce_scatter"))
    if separate:
        model.set_separate_reduce_scatter_group()
    model.set_reduce_scatter_max_input_buffers(2)
    got, want = [], []
    for tokens in batches(2, batch=8):
        got_g, want_g = _grads_after_backward(model, ref, tokens, rank, world_size)
        assert_close(got_g, want_g, TOL, f"{name}: gradients")
        got.append(0.0)
        want.append(0.0)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    assert_close(full_params(model), full_params(ref), TOL, f"{name}: parameters")
    kinds = [k for k, _ in log]
    # per step: root once + 2 blocks twice = 5 all-gathers; 3 reduce-scatters
    assert kinds.count("all_gather") == 10 and kinds.count("reduce_scatter") == 6, f"{name}: {kinds}"
    ag = {id(g): g for k, g in log if k == "all_gather"}
    rs = {id(g): g for k, g in log if k == "reduce_scatter"}
    ranks = dist.get_process_group_ranks
    assert all(ranks(g) == list(range(world_size)) for g in [*ag.values(), *rs.values()]), f"{name}: group ranks"
    assert (set(rs).isdisjoint(ag)) == separate, f"{name} separate={separate}: all-gather groups {list(ag)}, " \
                                                 f"reduce-scatter groups {list(rs)}"
    for bad, exc in ((True, TypeError), (1.5, TypeError), (0, ValueError)):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except exc:
            continue
        raise AssertionError(f"{name}: set_reduce_scatter_max_input_buffers({bad!r}) did not raise {exc.__name__}")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("separate", [False, True], ids=["shared_group", "separate_group"])
def test_custom_collectives_and_reduce_scatter_group(name, separate):
    """set_custom_all_gather / set_custom_reduce_scatter route every collective of the units
    through the user's objects (counted), training equals one process;
    set_separate_reduce_scatter_group hands the reduce-scatters another group over the same
    ranks; set_reduce_scatter_max_input_buffers(2) changes no number, and refuses bad input."""
    run_on_workers(_custom_comms, WORLD, name, separate, timeout=90)


# -- unshard in backward --------------------------------------------------------------------------
def _unshard_in_backward(rank, world_size, name):
    from tests.compat.test_setters import AllGathers

    i = impl(name)
    model = build(0)
    for b in model.blocks:
        i.fully_shard(b, mesh=_mesh(world_size, False))
    i.fully_shard(model.tok, mesh=_mesh(world_size, False), reshard_after_forward=True)
    i.fully_shard(model, mesh=_mesh(world_size, False))
    ref = build(0)
    counts = []
    for k, tokens in enumerate(batches(2, batch=8)):
        model.tok.set_unshard_in_backward(k == 1)
        loss_of(ref, tokens).backward()
        loss = loss_of(model, dp_slice(tokens, rank, world_size))
        mode = AllGathers()
        with mode:
            loss.backward()
        counts.append(len(mode.sizes))
        assert_close(full_params(model, grads=True), full_params(ref, grads=True), TOL, f"{name} step {k}: gradients")
        model.zero_grad()
        ref.zero_grad()
    # backward all-gathers: the two blocks, plus the embedding unit only when it unshards
    assert counts == [2, 3], f"{name}: backward all-gathers {counts}"


@pytest.mark.parametrize("name", IMPLS)
def test_set_unshard_in_backward(name):
    """An embedding unit with set_unshard_in_backward(False) is not all-gathered in backward
    (its gradient needs only the indices) and its gradient is still right."""
    run_on_workers(_unshard_in_backward, WORLD, name, timeout=90)


# -- microbatches, events, recovery ----------------------------------------------------------------
def _last_backward_and_event(rank, world_size, name):
    i = impl(name)
    model = shard(i, build(0), _mesh(world_size, False))
    ref = build(0)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    got, want = [], []
    for tokens in batches(3, batch=8):
        rows = dp_slice(tokens, rank, world_size)
        total = 0.0
        for k in range(2):  # two microbatches, each reducing; only the second is the last backward
            model.set_is_last_backward(k == 1)
            loss = loss_of(model, rows[k * 1:(k + 1) * 1]) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        model.set_post_optim_event(torch.Event("cpu"))
        t = torch.tensor([total])
        dist.all_reduce(t)
        got.append(t.item() / world_size)
        rl = loss_of(ref, tokens)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        want.append(rl.item())
    assert_losses(got, want, TOL, name)
    assert_close(full_params(model), full_params(ref), 2e-5, f"{name}: AdamW parameters")


@pytest.mark.parametrize("name", IMPLS)
def test_set_is_last_backward_and_post_optim_event(name):
    """Two reducing microbatches per step, set_is_last_backward(False) before the first and
    True before the second, set_post_optim_event after each optimizer step: AdamW training
    equals one process's."""
    run_on_workers(_last_backward_and_event, WORLD, name, timeout=90)


class _Boom(Exception):
    pass


def _reset_iter_state(rank, world_size, name, where):
    i = impl(name)
    model = shard(i, build(0), _mesh(world_size, False))
    ref = build(0)
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    data = batches(3, batch=8)
    fail = {"on": False}

    def raise_in_forward(module, args, output):
        if fail["on"] and where == "forward":
            raise _Boom()

    def raise_in_backward(grad):
        if fail["on"] and where == "backward":
            raise _Boom()
        return grad

    model.blocks[1].register_forward_hook(raise_in_forward)
    got, want = [], []
    for k, tokens in enumerate(data):
        fail["on"] = k == 1
        try:
            x = loss_of(model, dp_slice(tokens, rank, world_size))
            if where == "backward":
                x = x * 1.0
                x.register_hook(raise_in_backward)
            x.backward()
        except _Boom:
            try:
                model.blocks[0].reset_iter_state()
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"{name}: reset_iter_state on a non-root unit did not raise RuntimeError")
            model.reset_iter_state()
            opt.zero_grad()
            assert all(isinstance(p, DTensor) for b in model.blocks for p in b.parameters()), f"{name}: not resharded"
            continue
        opt.step()
        opt.zero_grad()
        got.append(x.item())
        rl = loss_of(ref, tokens)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
    assert len(got) == 2, f"{name}: {got}"
    assert_close(full_params(model), full_params(ref), TOL, f"{name}: parameters after a reset")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception(name, where):
    """A step whose forward (or backward) raised, then reset_iter_state() on the root (a
    RuntimeError on a non-root unit): parameters sharded again, and training goes on exactly
    like one process that skipped that batch."""
    run_on_workers(_reset_iter_state, WORLD, name, where, timeout=90)


# -- unused parameters ---------------------------------------------------------------------------
def _unused(rank, world_size, name, zeros):
    i = impl(name)
    model = shard(i, build(0), _mesh(world_size, False))
    ref = build(0)
    for m in (model, ref):
        m.norm.forward = lambda x: x  # the root's final norm is skipped: its parameters get no gradient
    if zeros:
        model.set_reduce_scatter_unused_params(True)
    loss_of(ref, batches(1, batch=8)[0]).backward()
    loss_of(model, dp_slice(batches(1, batch=8)[0], rank, world_size)).backward()
    for n in ("norm.weight", "norm.bias"):
        g = model.get_parameter(n).grad
        if zeros:
            assert g is not None and g.full_tensor().abs().max().item() == 0, f"{name}: {n}.grad {g}"
        else:
            assert g is None, f"{name}: {n}.grad should be None as on one process, got {g}"
    used = {n: p.grad.full_tensor() for n, p in model.named_parameters() if not n.startswith("norm.")}
    assert_close(used, {n: p.grad for n, p in ref.named_parameters() if not n.startswith("norm.")}, TOL, name)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("zeros", [False, True], ids=["none", "reduce_scatter_unused_params"])
def test_unused_parameters(name, zeros):
    """Parameters a forward does not use keep .grad None (as on one process); with
    set_reduce_scatter_unused_params(True) they get zero gradients; the used ones are right."""
    run_on_workers(_unused, WORLD, name, zeros, timeout=90)


# -- accepted for code written for CUDA; module-level functions -----------------------------------
def _cuda_switches_and_functions(rank, world_size, name):
    i = impl(name)
    share_comm_ctx, register_fsdp_forward_method = _module_fns(name)
    model = shard(i, build(0), _mesh(world_size, False))
    ref = build(0)
    model.set_allocate_memory_from_process_group_for_comm(True)
    share_comm_ctx([model, *model.blocks])
    try:
        share_comm_ctx([model, torch.nn.Linear(2, 2)])
    except ValueError:
        pass
    else:
        raise AssertionError(f"{name}: share_comm_ctx took a module that is not sharded")
    plain = torch.nn.Linear(2, 2)
    register_fsdp_forward_method(plain, "extra_repr")  # a plain module: nothing happens
    got, want = _grads_after_backward(model, ref, batches(1, batch=8)[0], rank, world_size)
    assert_close(got, want, TOL, f"{name}: gradients")
    model.set_symm_mem_for_comm()


TORCH_SYMM_MEM = pytest.mark.xfail(strict=True, raises=RankFailure, reason=(
    "torch 2.13 set_symm_mem_for_comm raises RuntimeError 'SymmetricMemory does not find allocation backend "
    "NCCL' on CPU; shardwise accepts it (no symmetric memory is used on any backend)"))


@pytest.mark.parametrize("name", [pytest.param("torch", marks=TORCH_SYMM_MEM), "shardwise"])
def test_cuda_only_switches_and_module_functions(name):
    """set_allocate_memory_from_process_group_for_comm, set_symm_mem_for_comm accepted on CPU;
    share_comm_ctx over units (ValueError for a plain module); register_fsdp_forward_method on
    a plain module is a no-op; gradients equal one process's."""
    run_on_workers(_cuda_switches_and_functions, WORLD, name, timeout=90)
