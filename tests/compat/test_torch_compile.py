"""Differential: ``torch.compile`` of sharded blocks, three ways: the module
(``torch.compile(block)``), in place (``block.compile()``), and ``forward`` only
(``block.forward = torch.compile(block.forward)``). Backend ``aot_eager``: dynamo and
AOTAutograd trace the block forward and backward as they do for inductor, but the graphs run
as eager aten ops, so no C++ compilation (CPU time) and numbers equal to eager within fp32
rounding."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.distributed.device_mesh import init_device_mesh

from tests._dist import run_on_workers
from tests.compat._adapter import (
    IMPLS, assert_close, assert_losses, batches, build, full_params, impl, reference, shard, train,
)

TOL = 1e-6
WORLD = 4
BACKEND = "aot_eager"


def _compiled(rank, world_size, name, how):
    torch._dynamo.reset()  # compiled code of earlier tests in these workers: not this test's
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = shard(i, build(0), mesh)
    for k, block in enumerate(model.blocks):
        if how == "torch.compile(block)":
            model.blocks[k] = torch.compile(block, backend=BACKEND)
        elif how == "block.compile()":
            block.compile(backend=BACKEND)
        else:
            block.forward = torch.compile(block.forward, backend=BACKEND)
    data = batches(3)
    ref, want = reference(data, optim=torch.optim.SGD, lr=0.1)
    got = train(model, torch.optim.SGD(model.parameters(), lr=0.1), data, rank, world_size)
    assert_losses(got, want, TOL, f"{name} {how}")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} {how}: parameters")
    return got


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()", "forward only"])
def test_compiled_blocks_train_like_one_process(name, how):
    run_on_workers(_compiled, WORLD, name, how, timeout=180)
