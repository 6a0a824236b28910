"""``loss_parallel`` against torch's on inputs that are / are not class-sharded (issue 33, item 12).

Inside torch's ``loss_parallel`` a DTensor given to ``F.cross_entropy``, ``F.nll_loss`` or
``F.log_softmax`` must be sharded on the class (softmax) dimension; otherwise torch raises a
``ValueError`` naming ``loss_parallel``. shardwise's must do the same on every rank (it raised
DTensor's dispatch ``RuntimeError`` for ``F.nll_loss``), and ``log_softmax`` + ``nll_loss`` on
class-sharded logits must give torch's loss and gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests._dist import run_ranks

C = 11  # classes: uneven on 2 ranks


def _bad_cases(mesh, z3, z2, t2, t1):
    return {
        "nll_loss Shard(0)": lambda: F.nll_loss(distribute_tensor(z2, mesh, [Shard(0)]), t1),
        "nll_loss Replicate": lambda: F.nll_loss(distribute_tensor(z2, mesh, [Replicate()]), t1),
        "nll_loss [B,C,T] Shard(2)": lambda: F.nll_loss(distribute_tensor(z3, mesh, [Shard(2)]), t2),
        "cross_entropy Shard(0)": lambda: F.cross_entropy(distribute_tensor(z2, mesh, [Shard(0)]), t1),
        "CrossEntropyLoss Replicate": lambda: nn.CrossEntropyLoss()(distribute_tensor(z2, mesh, [Replicate()]), t1),
        "log_softmax dim 1 of Shard(2)": lambda: F.log_softmax(distribute_tensor(z3, mesh, [Shard(2)]), 1),
        "log_softmax dim -1 of Shard(0)": lambda: F.log_softmax(distribute_tensor(z2, mesh, [Shard(0)]), -1),
    }


def _both(rank, world_size):
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    from shardwise.composable import loss_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    z3, t2 = torch.randn(2, C, 3, generator=g), torch.randint(0, C, (2, 3), generator=g)
    z2, t1 = torch.randn(6, C, generator=g), torch.randint(0, C, (6,), generator=g)
    t1[2] = -100
    raised = {}
    for name, call in _bad_cases(mesh, z3, z2, t2, t1).items():
        for impl, ctx in (("torch", torch_loss_parallel), ("ours", loss_parallel)):
            try:
                with ctx():
                    call()
                raised[name, impl] = "no error"
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                raised[name, impl] = f"{type(e).__name__}: {e}"
    # log_softmax + nll_loss on class-sharded logits, as torch's loss_parallel computes them
    values = {}
    for impl, ctx in (("torch", torch_loss_parallel), ("ours", loss_parallel), ("plain", None)):
        for name, (z, t, kw) in {"2d": (z2, t1, {}), "3d-sum": (z3, t2, {"reduction": "sum"}),
                                 # torch's backward fails on weight with an ignored target: none here
                                 "weight": (z2, t1.clamp_min(0), {"weight": torch.rand(C, generator=torch.Generator().manual_seed(1))})
                                 }.items():
            x = z.clone().requires_grad_()
            inp = x if ctx is None else distribute_tensor(z.clone(), mesh, [Shard(1)]).requires_grad_()
            if ctx is None:
                loss = F.nll_loss(F.log_softmax(inp, 1), t, **kw)
                loss.backward()
                values[name, impl] = (loss.item(), x.grad.clone(), "plain")
                continue
            with ctx():
                lp = F.log_softmax(inp, 1)
                loss = F.nll_loss(lp, t, **kw)
                loss.backward()
            placements = (tuple(lp.placements), tuple(loss.placements)) if isinstance(loss, DTensor) else None
            values[name, impl] = (loss.full_tensor().item(), inp.grad.full_tensor(), placements)
    return raised, values


def test_loss_parallel_refuses_inputs_not_sharded_on_the_class_dim_and_runs_nll_like_torch():
    results = run_ranks(_both, 2)
    for rank, (raised, values) in enumerate(results):
        for (name, impl), text in raised.items():
            if impl != "ours":
                continue
            assert raised[name, "torch"].startswith("ValueError"), (name, raised[name, "torch"])
            assert text.startswith("ValueError") and "loss_parallel" in text and "Shard(" in text, (rank, name, text)
        for name in ("2d", "3d-sum", "weight"):
            plain_loss, plain_grad, _ = values[name, "plain"]
            for impl in ("torch", "ours"):
                loss, grad, placements = values[name, impl]
                assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss), (rank, name, impl, loss, plain_loss)
                assert torch.allclose(grad, plain_grad, atol=1e-6), (rank, name, impl)
            # log_softmax keeps the class sharding; the loss is replicated, as torch's
            assert values[name, "ours"][2] == values[name, "torch"][2], (name, values[name, "ours"][2],
                                                                         values[name, "torch"][2])
