"""Differential: two meshes in one process, in both orders, on 4 persistent workers; and FSDP x
TP with only the transformer blocks TP'd (embedding and head on the dp axis alone)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests._dist import run_on_workers
from tests.compat._adapter import (
    IMPLS, assert_close, assert_losses, batches, build, full_params, impl, reference, shard, train,
)

TOL = 1e-6  # fp32; TP splits the head dim / hidden sums over 2 ranks, FSDP the batch over 2 or 4
WORLD = 4
OPT = torch.optim.SGD  # AdamW amplifies the ~1e-7 gradient differences of TP sums where gradients are near 0 (q/k)


class Run:
    """One model on one mesh, trained step by step and compared to the reference."""

    def __init__(self, name: str, layout: str, rank: int, world_size: int) -> None:
        i = impl(name)
        if layout == "1d":
            self.mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
            self.model = shard(i, build(0), self.mesh)
            self.dp_rank, self.dp_size = rank, world_size
        else:  # (dp, tp): blocks TP'd on mesh["tp"], every unit on mesh["dp"]
            self.mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
            self.model = shard(i, build(0), self.mesh["dp"], self.mesh["tp"])
            self.dp_rank, self.dp_size = self.mesh.get_local_rank("dp"), 2
        self.optim = OPT(self.model.parameters(), lr=0.1)
        self.losses: list[float] = []
        self.where = f"{name} {layout}"

    def steps(self, data) -> None:
        self.losses += train(self.model, self.optim, data, self.dp_rank, self.dp_size)

    def check(self, ref, want) -> None:
        assert_losses(self.losses, want, TOL, self.where)
        assert_close(full_params(self.model), full_params(ref), TOL, f"{self.where}: parameters")


def _two_meshes(rank, world_size, name, order):
    data = batches(3)
    ref, want = reference(data, lr=0.1, optim=OPT)
    first, second = order.split("_then_")
    a = Run(name, first, rank, world_size)
    a.steps(data[:2])
    b = Run(name, second, rank, world_size)  # a new mesh while the first model is alive
    b.steps(data)
    a.steps(data[2:])  # and the first model keeps training
    a.check(ref, want)
    b.check(ref, want)
    return a.losses, b.losses


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("order", ["1d_then_2d", "2d_then_2d"])
def test_two_meshes_in_one_process(name, order):
    """1-D FSDP then (dp, tp) FSDP x TP on a new mesh; or (dp, tp) twice on two equal meshes.
    Both models train to the reference, the first one after the second was built."""
    run_on_workers(_two_meshes, WORLD, name, order, timeout=120)
