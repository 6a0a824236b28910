"""What ``composable/_compat.py`` relies on in the installed torch: if an upgrade changes one of
these, this file fails first (and names the helper to adapt)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from shardwise.composable._compat import root_mesh, run_eagerly, set_local_tensor
from tests._dist import run_ranks
from tests._models import make_mesh


def _local_and_root(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = make_mesh((world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))
    new = torch.arange(6.0).view(2, 3)
    set_local_tensor(p, new)
    ok_local = p.to_local().data_ptr() == new.data_ptr() and torch.equal((p * 2).to_local(), new * 2)
    ok_full = torch.equal(p.full_tensor()[2 * rank : 2 * rank + 2], new)
    m2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    return ok_local, ok_full, root_mesh(m2["b"]) is m2, root_mesh(m2) is m2


def test_set_local_tensor_and_root_mesh():
    for got in run_ranks(_local_and_root, 2):
        assert got == (True, True, True, True), got


def test_run_eagerly_is_not_traced():
    seen = []

    def hook(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    eager = run_eagerly(hook)

    def f(x):
        return eager(x * 2) * 3

    assert eager(torch.ones(1)).item() == 2 and seen == [False]
    out = torch.compile(f, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 9.0)) and seen == [False, False], seen
