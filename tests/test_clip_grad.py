"""clip_grad_norm_ over sharded DTensor gradients against torch's on one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from shardwise.composable import clip_grad_norm_, fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import batches, loss_fn, make_mesh, reference_and_copy

TOL = 1e-6
NORMS = (2.0, 1.0, math.inf)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _AllReduceCounter:
    """Counts dist.all_reduce calls (the collectives clip_grad_norm_ issues)."""

    def __enter__(self):
        self.calls, self._real = 0, dist.all_reduce

        def spy(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.all_reduce = spy
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _compare_clipping(ref_params, params) -> dict:
    """For each norm type: clip the reference with torch and ``params`` with ours, starting
    from the same gradients; return norm and clipped-gradient errors and the collective count."""
    ref_grads = [p.grad.clone() for p in ref_params]
    grads = [p.grad.clone() for p in params]
    out = {}
    for norm_type in NORMS:
        for p, g in zip(ref_params, ref_grads):
            p.grad = g.clone()
        for p, g in zip(params, grads):
            p.grad = g.clone()
        unclipped = torch.nn.utils.clip_grad_norm_(ref_params, math.inf, norm_type)
        max_norm = 0.3 * unclipped.item()  # the reference does clip
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
        with _AllReduceCounter() as counter:
            norm = clip_grad_norm_(params, max_norm, norm_type)
        # as torch: a 0-d DTensor, Replicate on its mesh, when gradients are DTensors (issue 33 item 10)
        assert isinstance(norm, DTensor) and norm.dim() == 0, f"norm is a 0-d DTensor: {norm!r}"
        assert all(pl.is_replicate() for pl in norm.placements), norm.placements
        assert norm.to_local().item() == norm.full_tensor().item() == norm.item(), norm
        out[norm_type] = dict(
            norm=abs(norm.item() - ref_norm.item()) / ref_norm.item(),
            grads=maxerr(_rel(_full(p.grad), r.grad) for p, r in zip(params, ref_params)),
            value=norm.item(),
            collectives=counter.calls,
        )
    return out


def _forward_backward(ref, model, dp_rank, dp_size):
    (tokens, target), = batches(1, 8)
    loss_fn(ref(tokens), target).backward()
    per = 8 // dp_size
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    loss_fn(model(tokens[sl]), target[sl]).backward()


def _fsdp_or_hsdp(rank, world_size, mesh_shape):
    mesh = make_mesh(mesh_shape)
    ref, model = reference_and_copy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _forward_backward(ref, model, rank, world_size)
    placements = {tuple(p.grad.placements) for p in model.parameters()}
    return placements, _compare_clipping(list(ref.parameters()), list(model.parameters()))


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))],
                         ids=["fsdp2", "fsdp4-empty-shards", "hsdp2x2"])
def test_clip_matches_torch_on_fsdp_and_hsdp(world_size, mesh_shape):
    results = run_ranks(_fsdp_or_hsdp, world_size, mesh_shape)
    for rank, (placements, per_norm) in enumerate(results):
        assert len(placements) == 1, placements  # one sharding -> one all-reduce, not one per parameter
        for norm_type, r in per_norm.items():
            assert r["norm"] <= TOL and r["grads"] <= TOL, (rank, norm_type, r)
            assert r["collectives"] == 1, (rank, norm_type, r)
            assert r["value"] == results[0][1][norm_type]["value"], "the norm is the same on every rank"


def _mixed(rank, world_size):
    """FSDP params on the dp axis, two ignored (plain) params, and a hand-made (Shard(1),)
    gradient on the tp axis of a 2 x 2 (dp_shard x tp) mesh."""
    from shardwise.mesh import init_mesh

    mesh = init_mesh(dp_shard=2, tp=2)
    dp_mesh, tp_mesh = mesh["dp_shard"], mesh["tp"]
    ref, model = reference_and_copy()
    ignored = [model.scale, model.head.bias]
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
    dp_rank = dp_mesh.get_local_rank()
    _forward_backward(ref, model, dp_rank, 2)
    for p in ignored:  # fully_shard does not reduce ignored params: average them like DDP would
        dist.all_reduce(p.grad, group=dp_mesh.get_group())
        p.grad /= 2
    g = torch.Generator().manual_seed(7)
    w, grad = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)  # 5 columns: 3 + 2 on 2 ranks
    ref_extra = nn.Parameter(w.clone())
    ref_extra.grad = grad.clone()
    extra = nn.Parameter(distribute_tensor(w, tp_mesh, [Shard(1)], src_data_rank=None))
    extra.grad = distribute_tensor(grad, tp_mesh, [Shard(1)], src_data_rank=None)
    kinds = sorted({type(p.grad).__name__ + str(getattr(p.grad, "placements", "")) for p in model.parameters()})
    out = _compare_clipping([*ref.parameters(), ref_extra], [*model.parameters(), extra])
    return kinds, extra.grad.to_local().shape[1], out


def test_clip_matches_torch_with_mixed_meshes_and_plain_tensors():
    results = run_ranks(_mixed, 4)
    for rank, (kinds, local_cols, per_norm) in enumerate(results):
        assert kinds == ["DTensor(Shard(dim=0),)", "Tensor"], kinds
        assert local_cols == (3 if rank % 2 == 0 else 2), local_cols
        for norm_type, r in per_norm.items():
            assert r["norm"] <= TOL and r["grads"] <= TOL, (rank, norm_type, r)
            # one all-reduce for the dp-sharded group, one for the tp-sharded one, none for plain
            assert r["collectives"] == 2, (rank, norm_type, r)
            assert r["value"] == results[0][2][norm_type]["value"], "the norm is the same on every rank"


def _partial_and_nonfinite(rank, world_size):
    mesh = make_mesh((world_size,))
    g = torch.Generator().manual_seed(3)
    pieces = [torch.randn(4, 3, generator=g) for _ in range(world_size)]
    ref = nn.Parameter(torch.zeros(4, 3))
    ref.grad = sum(pieces)
    p = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    p.grad = DTensor.from_local(pieces[rank].clone(), mesh, [Partial()], run_check=False)
    ref_norm = torch.nn.utils.clip_grad_norm_([ref], 1.0)
    norm = clip_grad_norm_([p], 1.0)
    partial = (abs(norm.item() - ref_norm.item()) / ref_norm.item(), _rel(p.grad.full_tensor(), ref.grad))
    # a nan on one rank makes the global norm nan everywhere: every rank raises
    q = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    q.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    if rank == 1:
        q.grad.to_local()[0, 0] = float("nan")
    try:
        clip_grad_norm_([q], 1.0, error_if_nonfinite=True)
        raised = "no error"
    except RuntimeError as e:
        raised = str(e)
    return partial, raised


def test_partial_gradients_and_nonfinite_norm():
    for rank, ((norm_err, grad_err), raised) in enumerate(run_ranks(_partial_and_nonfinite, 2)):
        assert norm_err <= TOL and grad_err <= TOL, (rank, norm_err, grad_err)
        assert "total norm of order 2.0" in raised and "nan" in raised and "error_if_nonfinite=False" in raised, raised


# -- plain tensors on one process (no collectives) ---------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_plain_tensors_match_torch(norm_type, foreach):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (0, 2), (2, 2, 2)]
    ref = [nn.Parameter(torch.zeros(s)) for s in shapes]
    ours = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for r, o in zip(ref, ours):
        r.grad = torch.randn(r.shape, generator=g)
        o.grad = r.grad.clone()
    ours[1].grad = None  # skipped, like torch
    ref[1].grad = None
    ref[2].grad = None  # torch's inf-norm fails on an empty tensor; ours counts it as 0 (empty shards)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type)
    got = clip_grad_norm_(iter(ours), 0.5, norm_type, foreach=foreach)  # a generator works
    assert type(got) is torch.Tensor and got.dim() == 0, "plain gradients: a plain tensor, as torch"
    assert abs(got.item() - want.item()) <= TOL * want.item()
    for r, o in zip(ref, ours):
        if r.grad is not None and r.grad.numel():
            assert _rel(o.grad, r.grad) <= TOL


def test_edge_cases():
    assert clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0  # no grads
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm_(p, 10.0).item() == 5.0 and p.grad.tolist() == [3.0, 4.0, 0.0]  # one tensor, no clip
    with pytest.raises(ValueError, match="norm_type=-1"):
        clip_grad_norm_(p, 1.0, norm_type=-1)
    p.grad = torch.tensor([float("inf"), 0.0, 0.0])
    with pytest.raises(RuntimeError, match="total norm of order 2.0 .* is inf"):
        clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
