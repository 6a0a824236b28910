"""shardwise's own checks of FSDPModule methods whose effect FSDP2 on CPU does not show (what is
in flight when), and of their bad-input errors (the differential tests are in
tests/compat/test_fsdp_module_api.py)."""

from __future__ import annotations

import pytest
import torch

from shardwise.composable import fully_shard
from shardwise.composable._fsdp._reduce import ReduceStage
from shardwise.composable._fsdp._state import get_state
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, max_param_error, reference_and_copy

TOL = 1e-6


def _shard(model, mesh):
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _in_flight(rank, world_size):
    ref, model = reference_and_copy(n_blocks=3)
    _shard(model, make_mesh((world_size,)))
    ctx_of = lambda: get_state(model).ctx  # noqa: E731
    (tokens, target), = batches(1, 8)
    per = 8 // world_size
    rows = slice(rank * per, (rank + 1) * per)
    half = [slice(rows.start, rows.start + per // 2), slice(rows.start + per // 2, rows.stop)]
    seen = {}
    for k, sl in enumerate(half):
        model.set_is_last_backward(k == 1)
        (loss_fn(model(tokens[sl]), target[sl]) / 2).backward()
        seen[k] = len(ctx_of().reduces)
    assert seen[0] > 0 and seen[1] == 0, f"reductions in flight after each backward: {seen}"
    loss_fn(ref(tokens), target).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        err = ((got[n] - p.grad).abs().max() / p.grad.abs().max()).item()
        assert err <= TOL, f"{n}: {err}"
    # at most n reduce-scatters in flight: count them as each unit issues its own
    model.zero_grad()
    counts = []
    real = ctx_of().keep_in_flight

    def keep(issued):
        real(issued)
        counts.append(sum(pr.stage is ReduceStage.SCATTER for pr in ctx_of().reduces))
    ctx_of().keep_in_flight = keep
    for n in (1, 2):
        model.set_reduce_scatter_max_input_buffers(n)
        counts.clear()
        loss_fn(model(tokens[rows]), target[rows]).backward()
        seen[f"max {n}"] = max(counts)
    assert seen["max 1"] == 1 and seen["max 2"] == 2, seen
    return True


def test_set_is_last_backward_and_max_input_buffers_in_flight():
    """set_is_last_backward(False): the end of that backward leaves reductions in flight, the
    last backward finishes them (gradients then equal one process's); with
    set_reduce_scatter_max_input_buffers(n) at most n reduce-scatters are in flight at once."""
    assert run_ranks(_in_flight, 2) == [True, True]


class _Comm:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _bad_input(rank, world_size):
    _, model = reference_and_copy()
    _shard(model, make_mesh((world_size,)))
    msgs = {}
    cases = {
        "factor": (lambda: model.set_gradient_divide_factor(0), ValueError),
        "factor type": (lambda: model.set_gradient_divide_factor("2"), ValueError),
        "hook": (lambda: model.set_all_reduce_hook(3), TypeError),
        "comm": (lambda: model.set_custom_all_gather(object()), TypeError),
        "symm backend": (lambda: model.set_symm_mem_for_comm("NVSHMEM"), ValueError),
        "buffers": (lambda: model.set_reduce_scatter_max_input_buffers(0), ValueError),
        "share": (lambda: __import__("shardwise.composable").composable.share_comm_ctx([torch.nn.Linear(1, 1)]),
                  ValueError),
    }
    model.blocks[0].set_custom_all_gather(_Comm())
    cases["pg alloc after custom"] = (lambda: model.blocks[0].set_allocate_memory_from_process_group_for_comm(True),
                                      ValueError)
    cases["symm after custom"] = (lambda: model.blocks[0].set_symm_mem_for_comm(), ValueError)
    for name, (call, exc) in cases.items():
        with pytest.raises(exc) as info:
            call()
        msgs[name] = str(info.value)
    model(batches(1, 2)[0][0])  # lazy init: the root is known
    with pytest.raises(RuntimeError, match="not the root"):
        model.blocks[0].reset_iter_state()
    return msgs


def test_bad_input_is_one_line_naming_the_fix():
    """Each bad argument: the documented exception type, one line, the same on every rank."""
    a, b = run_ranks(_bad_input, 2)
    assert a == b
    for name, msg in a.items():
        assert "\n" not in msg and len(msg) > 20, f"{name}: {msg!r}"


def _custom_all_gather_trains(rank, world_size):
    ref, model = reference_and_copy()
    _shard(model, make_mesh((world_size,)))
    model.set_custom_all_gather(_Comm())
    for b in model.blocks:
        b.set_custom_all_gather(_Comm())
    from tests._models import train_pair

    worst = train_pair(ref, model, rank, world_size)
    return worst, maxerr(max_param_error(ref, model).values())


def test_custom_all_gather_on_uneven_shards():
    """A custom all-gather (the protocol, duck-typed) on the uneven, empty-shard layouts of the
    test model: training equals one process's."""
    for worst, err in run_ranks(_custom_all_gather_trains, 4):
        assert worst <= TOL and err <= 1e-5, (worst, err)
