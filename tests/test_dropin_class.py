"""The ``FSDP<cls>`` class and what comes with it, as code written for FSDP2 expects: a slice of
a sharded ``nn.Sequential`` is a plain ``nn.Sequential`` (of sharded children) that trains like
the same slice of an unsharded copy; ``copy.deepcopy`` of a sharded module raises a clear
``AssertionError``; ``fully_shard`` refuses ``nn.ModuleList`` / ``nn.ModuleDict`` (no forward
to hook) up front; ``fully_shard.state(module)`` gives the unit's state object; the misuses FSDP2
refuses with ``AssertionError`` (sharding a module twice, a ``shard_placement_fn`` dim that does
not fit) raise ``FullyShardUsageError``, both that and a ``ValueError``, with FSDP2's words. Found
by running torch's own FSDP2 unit tests with their imports rebound (docs/testing.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.composable import FSDPModule, FullyShardUsageError, fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks

TOL = 1e-6  # fp32, relative


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Linear(5, 3))


def _slice(rank, world_size):
    ref = _chain()
    model = copy.deepcopy(ref)
    for i in (0, 2, 3):
        fully_shard(model[i])
    fully_shard(model)
    head = model[:3]
    kinds = (type(head) is nn.Sequential, isinstance(head, FSDPModule), type(model[1:]).__name__)
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 6)
    out, ref_out = head(x), ref[:3](x)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    errs = [((out - ref_out).abs().max() / ref_out.abs().max()).item()]
    for i in (0, 2):
        for p, q in zip(model[i].parameters(), ref[i].parameters()):
            g = q.grad.clone()
            dist.all_reduce(g)
            g /= world_size
            errs.append(((p.grad.full_tensor() - g).abs().max() / g.abs().max()).item())
    assert all(p.grad is None for p in model[3].parameters()), "the unit outside the slice has no gradient"
    # the whole model still runs after its slice did
    model(x).sum().backward()
    return kinds, maxerr(errs)


def test_slice_of_sharded_sequential_is_plain_and_trains():
    for kinds, err in run_ranks(_slice, 2):
        assert kinds == (True, False, "Sequential"), kinds
        assert err <= TOL, err


def _copies(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    try:
        copy.deepcopy(model)
        raised = ""
    except AssertionError as e:
        raised = str(e)
    shallow = copy.copy(model)  # copy.copy / pickle build the class without arguments: unchanged
    return raised, type(shallow) is type(model)


def test_deepcopy_of_sharded_module_raises_clearly_on_every_rank():
    for raised, shallow_same in run_ranks(_copies, 2):
        assert "FSDP does not support deepcopy" in raised and "before calling fully_shard" in raised, raised
        assert shallow_same


def _containers(rank, world_size):
    errors = []
    for container in (nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleDict({"a": nn.Linear(4, 4)})):
        with pytest.raises(ValueError, match="does not support containers that do not implement forward") as e:
            fully_shard(container)
        errors.append(str(e.value))
        assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in container.parameters())

    class Looped(nn.ModuleList):  # a list that does implement forward is a fine unit
        def forward(self, x):
            for m in self:
                x = m(x)
            return x

    torch.manual_seed(0)
    looped = Looped([nn.Linear(4, 4), nn.Linear(4, 4)])
    ref = copy.deepcopy(looped)
    fully_shard(looped)
    x = torch.randn(2, 4)
    err = (looped(x) - ref(x)).abs().max().item()
    return errors, err


def test_containers_without_forward_are_refused_up_front():
    for errors, err in run_ranks(_containers, 2):
        assert errors[0].startswith("fully_shard(ModuleList):") and "fully_shard(list(container))" in errors[0]
        assert errors[1].startswith("fully_shard(ModuleDict):")
        assert err <= TOL, err


def _states(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard([model[0], model[1]])
    fully_shard(model)
    pair, root = fully_shard.state(model[0]), fully_shard.state(model)
    return (pair is fully_shard.state(model[1]), pair is not None and root is not None and pair is not root,
            fully_shard.state(model[2]) is None)


def test_fully_shard_state_gives_one_object_per_call():
    for same_pair, distinct, plain in run_ranks(_states, 2):
        assert same_pair and distinct and plain


def _misuses(rank, world_size):
    """``(exception class names, message)`` of each misuse, caught once as ``AssertionError``
    (FSDP2's code) and once as ``ValueError`` (shardwise's), and whether the model stayed whole."""
    out = {}
    for catch in (AssertionError, ValueError):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model)
        try:
            fully_shard(model)
            out[("twice", catch.__name__)] = None
        except catch as e:
            out[("twice", catch.__name__)] = (type(e).__name__, str(e))
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
        try:
            fully_shard(model, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(1))
            out[("dim", catch.__name__)] = None
        except catch as e:
            plain = not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
            out[("dim", catch.__name__)] = (type(e).__name__, str(e), plain)
    scalar = nn.Linear(2, 2)
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError) as e:
        fully_shard(scalar)
    out["0-d"] = (type(e.value).__name__, str(e.value))
    return out


def test_fsdp2_assertion_misuses_are_both_assertion_and_value_errors():
    assert issubclass(FullyShardUsageError, ValueError) and issubclass(FullyShardUsageError, AssertionError)
    for rank, out in enumerate(run_ranks(_misuses, 2)):
        for catch in ("AssertionError", "ValueError"):
            name, msg = out[("twice", catch)]
            assert name == "FullyShardUsageError", (rank, name, msg)
            # torch's test_fully_shard_reapply matches this sentence; ours also names the fix
            assert "Each distinct composable distributed API can only be applied to a module once." in msg, msg
            assert msg.startswith("fully_shard(FSDPSequential): this module is already sharded") and "\n" not in msg
            assert "set_reshard_after_forward" in msg, msg
            name, msg, plain = out[("dim", catch)]
            assert name == "FullyShardUsageError" and plain, (rank, name, msg)
            # torch's test_invalid_shard_dim matches "Shard dim 1 is invalid for 1D tensor"
            assert "Shard dim 1 is invalid for 1D tensor" in msg and "'0.bias' of shape (16,)" in msg, msg
            assert "return a dim in [-1, 0]" in msg and "\n" not in msg, msg
        # a 0-d parameter stays a plain ValueError (as FSDP2), with FSDP2's fix in its words
        name, msg = out["0-d"]
        assert name == "ValueError" and "Change scale to a 1D tensor with numel equal to 1" in msg, msg
        assert "'scale' is 0-d" in msg and "ignored_params" in msg, msg
