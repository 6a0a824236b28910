"""Differential: ``torch.compile`` of sharded blocks, three ways: the module
(``torch.compile(block)``), in place (``block.compile()``), and ``forward`` only
(``block.forward = torch.compile(block.forward)``). Backend ``aot_eager``: dynamo and
AOTAutograd trace the block forward and backward as they do for inductor, but the graphs run
as eager aten ops, so no C++ compilation (CPU time) and numbers equal to eager within fp32
rounding. torch's side is golden data (`tests/compat/_golden.py`: its losses and parameters,
checked here against the one-process run like shardwise's)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.distributed.device_mesh import init_device_mesh

from tests._dist import run_on_workers
from tests.compat._adapter import (
    assert_close, assert_losses, batches, build, full_params, impl, reference, shard, train,
)
from tests.compat._golden import golden, record_each

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
    params = full_params(model)
    assert_close(params, full_params(ref), TOL, f"{name} {how}: parameters")
    return {"losses": got, "params": params}


HOWS = {"torch.compile(block)": "torch_compile_module", "block.compile()": "torch_compile_in_place",
        "forward only": "torch_compile_forward_only"}  # how: golden name


def _torch_side(tmp, how: str):
    return run_on_workers(_compiled, WORLD, "torch", how, timeout=180)[0]


record_each({name: (how,) for how, name in HOWS.items()}, _torch_side)


@pytest.mark.parametrize("how", HOWS)
def test_torchs_recorded_run_trains_like_one_process(how):
    ref, want = reference(batches(3), optim=torch.optim.SGD, lr=0.1)
    torch_side = golden(HOWS[how])
    assert_losses(torch_side["losses"], want, TOL, f"torch {how}")
    assert_close(torch_side["params"], full_params(ref), TOL, f"torch {how}: parameters")


@pytest.mark.parametrize("how", HOWS)
def test_compiled_blocks_train_like_one_process(how):
    got = run_on_workers(_compiled, WORLD, "shardwise", how, timeout=180)[0]
    assert_losses(got["losses"], golden(HOWS[how])["losses"], TOL, f"shardwise {how} vs torch's")
