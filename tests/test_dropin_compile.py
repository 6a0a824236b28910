"""``torch.compile`` on sharded blocks, the three ways FSDP2 users write it: compile the module
(``torch.compile(block)``), ``block.compile()``, compile only ``block.forward`` -- and the
whole model (``torch.compile(model)`` after sharding). The unit's
hooks and collectives run eagerly around the compiled compute; training equals one process.

``aot_eager`` (tracing + autograd graphs, no code generation) keeps the test fast on a small CPU
host; ``SHARDWISE_COMPILE_BACKEND=inductor`` runs the same test with inductor."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from shardwise.composable import fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import Net, make_mesh, train_pair

TOL = 1e-6  # fp32, relative: the compiled graph computes the same ops as eager
BACKEND = os.environ.get("SHARDWISE_COMPILE_BACKEND", "aot_eager")


def _compile(block, how, backend):
    if how == "module":
        return torch.compile(block, backend=backend)
    if how == "method":
        block.compile(backend=backend)
        return block
    block.forward = torch.compile(block.forward, backend=backend)
    return block


def _train(rank, world, how, backend, impl, steps=3):
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    mesh = make_mesh((world,))
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    for i, b in enumerate(model.blocks):
        shard(b, mesh=mesh)
        if how != "root":
            model.blocks[i] = _compile(b, how, backend)
    shard(model, mesh=mesh)
    if how == "root":  # the whole model: graph breaks at every unit's hooks
        model = torch.compile(model, backend=backend)
    worst = train_pair(ref, model, rank, world, steps=steps)
    want = dict(ref.named_parameters())
    perr = maxerr(((p.full_tensor() - want[n.replace("_orig_mod.", "")]).abs().max()
                / want[n.replace("_orig_mod.", "")].abs().max()).item() for n, p in model.named_parameters())
    return worst, perr


HOWS = ("module", "method", "forward", "root")


def _variants(rank, world, backend, impl):
    """The three variants one after another in the same rank processes."""
    return {how: _train(rank, world, how, backend, impl) for how in HOWS}


@pytest.mark.parametrize("impl", ["shardwise", "torch"])
def test_compiled_blocks_train_like_one_process(impl):
    """shardwise, and torch's FSDP2 as the oracle: the three variants equal one process."""
    for rank, results in enumerate(run_ranks(_variants, 2, BACKEND, impl, timeout=300)):
        for how, (lerr, perr) in results.items():
            assert lerr <= TOL and perr <= TOL, f"{impl} rank {rank} compile {how}: loss {lerr:.2e}, param {perr:.2e}"


def _hooks_not_traced(rank, world):
    """The unit's hooks are not in the graph: one graph for both blocks over three steps
    (no recompilation from the parameter swaps) and no collective traced."""
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    _train(rank, world, "module", "eager", "shardwise")
    return dict(dynamo_utils.counters["stats"])


def test_hooks_run_eagerly_around_the_compiled_forward():
    stats = run_ranks(_hooks_not_traced, 2, timeout=120)[0]
    assert stats.get("unique_graphs") == 1, stats
