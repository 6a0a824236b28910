"""``clip_grad_norm_`` against torch's on torch's own ``fully_shard`` model (issue 33, item 10).

torch's ``torch.nn.utils.clip_grad_norm_`` on an FSDP2 model returns a 0-d DTensor on the
gradients' mesh, and user code (torchtitan, Lightning) calls ``total_norm.full_tensor()`` on it.
shardwise's must return the same type on the same mesh with the same value, and clip the same.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardwise.composable import clip_grad_norm_, fully_shard
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy

NORMS = (2.0, 1.0, math.inf)


def _describe(norm):
    if not isinstance(norm, DTensor):
        return {"type": type(norm).__name__, "value": norm.item(), "dim": norm.dim()}
    mesh = norm.device_mesh
    return {"type": "DTensor", "value": norm.full_tensor().item(), "dim": norm.dim(),
            "mesh": (tuple(mesh.shape), mesh.mesh_dim_names, mesh.mesh.tolist()),
            "placements": [repr(p) for p in norm.placements], "dtype": str(norm.dtype)}


def _clip_both(rank, world_size, shape):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = make_mesh(shape)
    theirs, ours = reference_and_copy()
    for model, shard in ((theirs, torch_fully_shard), (ours, fully_shard)):
        for b in model.blocks:
            shard(b, mesh=mesh)
        shard(model, mesh=mesh)
        (tokens, target), = batches(1, 8)
        per = 8 // world_size
        sl = slice(rank * per, (rank + 1) * per)
        loss_fn(model(tokens[sl]), target[sl]).backward()
    out = {}
    grads_t = [p.grad.full_tensor() for p in theirs.parameters()]
    grads_o = [p.grad.full_tensor() for p in ours.parameters()]
    for norm_type in NORMS:
        max_norm = 0.5
        nt = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
        no = clip_grad_norm_(ours.parameters(), max_norm, norm_type)
        clipped = max(((p.grad.full_tensor() - q.grad.full_tensor()).abs().max()).item()
                      for p, q in zip(theirs.parameters(), ours.parameters()))
        out[norm_type] = {"torch": _describe(nt), "ours": _describe(no), "item": no.item(), "clipped_diff": clipped}
        # restore the unclipped gradients for the next norm type
        for model, grads in ((theirs, grads_t), (ours, grads_o)):
            for p, g in zip(model.parameters(), grads):
                p.grad.to_local().copy_(_shard_of(g, p.grad))
    # no DTensor gradient: a plain tensor in both
    lin_t, lin_o = nn.Linear(2, 2), nn.Linear(2, 2)
    for lin in (lin_t, lin_o):
        lin.weight.grad = torch.ones(2, 2)
    out["plain"] = {"torch": _describe(torch.nn.utils.clip_grad_norm_(lin_t.parameters(), 1.0)),
                    "ours": _describe(clip_grad_norm_(lin_o.parameters(), 1.0))}
    return out


def _shard_of(full, grad):
    """This rank's local piece of ``full`` laid out like ``grad`` (a DTensor)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, grad.device_mesh, grad.placements, src_data_rank=None).to_local()


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["fsdp2", "hsdp2x2"])
def test_clip_grad_norm_returns_torchs_dtensor(shape):
    results = run_ranks(_clip_both, math.prod(shape), shape)
    for rank, out in enumerate(results):
        assert out["plain"]["torch"] == out["plain"]["ours"], (rank, out["plain"])
        assert out["plain"]["ours"]["type"] == "Tensor", out["plain"]
        for norm_type in NORMS:
            r = out[norm_type]
            t, o = r["torch"], r["ours"]
            assert o["type"] == t["type"] == "DTensor", (rank, norm_type, r)
            assert o["mesh"] == t["mesh"] and o["dim"] == t["dim"] == 0 and o["dtype"] == t["dtype"], (rank, r)
            assert math.isclose(o["value"], t["value"], rel_tol=1e-6), (rank, norm_type, r)
            assert math.isclose(r["item"], t["value"], rel_tol=1e-6), (rank, norm_type, r)
            # torch: Replicate for finite p; Partial(max) on the shard axis for inf, whose
            # full_tensor() is the same number; ours is Replicate throughout ([Note: the returned norm])
            assert all(p == "Replicate()" for p in o["placements"]), o
            if norm_type != math.inf:
                assert o["placements"] == t["placements"], (rank, norm_type, r)
            assert r["clipped_diff"] <= 1e-6, (rank, norm_type, r)
