"""Differential: every TP style's constructor arguments and ``loss_parallel``, torch vs shardwise.

Each scenario runs once per implementation on 4 persistent gloo workers against one
single-process reference (fp32, 1e-6 relative): ``ColwiseParallel`` / ``RowwiseParallel`` with
each of ``input_layouts``, ``output_layouts``, ``use_local_output`` on ``nn.Linear`` and
``nn.Embedding``; ``SequenceParallel(sequence_dim, use_local_output)`` on a norm with plain and
DTensor inputs; ``PrepareModuleInput`` (positional, ``None`` placeholders, keyword layouts,
``use_local_output``), ``PrepareModuleOutput``, ``PrepareModuleInputOutput(use_local_input)``;
``loss_parallel`` with weights and every reduction, backward inside the context as torch asks.
Sizes divide 4: torch takes plain ``Shard`` inputs as equal pieces, and so does shardwise by
default. Gradients are compared as full tensors (torch leaves a sequence-parallel norm's
gradient ``Partial``, shardwise all-reduces it to the parameter's ``Replicate``: same values).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests._dist import run_on_workers
from tests.compat._adapter import IMPLS, impl, rel_err

WORLD = 4
TOL = 1e-6


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad) for n, p in m.named_parameters() if p.grad is not None}


def _compare(ref: nn.Module, tp: nn.Module, out_ref, out_tp, where: str) -> dict[str, float]:
    errs = {f"{where}:out": rel_err(_full(out_tp), out_ref.detach())}
    g_ref, g_tp = _grads(ref), _grads(tp)
    assert g_ref.keys() == g_tp.keys(), (where, sorted(g_ref), sorted(g_tp))
    errs.update({f"{where}:grad:{n}": rel_err(g_tp[n], g_ref[n]) for n in g_ref})
    return errs


def _chunk(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim)[rank].contiguous()


def _linear_and_embedding(rank, world_size, name):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,))
    col, row = i.ColwiseParallel, i.RowwiseParallel
    torch.manual_seed(0)
    x, ids = torch.randn(8, 16), torch.randint(0, 16, (4, 8))
    kinds = {}
    errs: dict[str, float] = {}
    cases = {  # name: (module, style, input on this rank, reference input, dim of the output shard or None)
        "col_default": (nn.Linear(16, 8), col(), x, x, -1),
        "col_in_shard0": (nn.Linear(16, 8), col(input_layouts=Shard(0)), _chunk(x, 0, rank, world_size), x, -1),
        "col_out_replicate": (nn.Linear(16, 8), col(output_layouts=Replicate()), x, x, None),
        "col_dtensor_out": (nn.Linear(16, 8), col(use_local_output=False), x, x, None),
        "row_default": (nn.Linear(16, 8), row(), _chunk(x, -1, rank, world_size), x, None),
        "row_out_shard0": (nn.Linear(16, 8), row(output_layouts=Shard(0)), _chunk(x, -1, rank, world_size), x, 0),
        "row_in_replicate": (nn.Linear(16, 8), row(input_layouts=Replicate()), x, x, None),
        "row_dtensor_out": (nn.Linear(16, 8), row(use_local_output=False), _chunk(x, -1, rank, world_size), x, None),
        "emb_col": (nn.Embedding(16, 8), col(), ids, ids, -1),
        "emb_row": (nn.Embedding(16, 8), row(input_layouts=Replicate()), ids, ids, None),
        "emb_row_seq": (nn.Embedding(16, 8), row(input_layouts=Replicate(), output_layouts=Shard(1)), ids, ids, 1),
    }
    for key, (ref, style, inp, ref_inp, shard_dim) in cases.items():
        tp = i.parallelize_module(copy.deepcopy(ref), mesh, style)
        out = tp(inp)
        kinds[key] = type(out).__name__
        full_out = out if isinstance(out, DTensor) or shard_dim is None else \
            DTensor.from_local(out, mesh, [Shard(shard_dim)], run_check=False)
        want = ref(ref_inp)
        want.sum().backward()
        (full_out.full_tensor() if isinstance(full_out, DTensor) else full_out).sum().backward()
        errs.update(_compare(ref, tp, want, full_out, key))
    # requires_grad is kept per parameter
    frozen = nn.Linear(16, 8)
    frozen.weight.requires_grad_(False)
    for key, style in (("col", col()), ("row", row())):
        m = i.parallelize_module(copy.deepcopy(frozen), mesh, style)
        kinds[f"requires_grad:{key}"] = (m.weight.requires_grad, m.bias.requires_grad)
    return errs, kinds


@pytest.mark.parametrize("name", IMPLS)
def test_colwise_and_rowwise_arguments_on_linear_and_embedding(name):
    for errs, kinds in run_on_workers(_linear_and_embedding, WORLD, name, timeout=120):
        bad = {k: e for k, e in errs.items() if not e <= TOL}
        assert not bad, f"{name}: {bad}"
        assert kinds["col_default"] == kinds["row_default"] == "Tensor", kinds
        assert kinds["col_dtensor_out"] == kinds["row_dtensor_out"] == "DTensor", kinds
        assert kinds["requires_grad:col"] == kinds["requires_grad:row"] == (False, True), kinds


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _sequence_parallel(rank, world_size, name):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12)
    errs, kinds = {}, {}
    for key, norm, style, inp, seq_dim in (
        ("ln_plain", nn.LayerNorm(12), i.SequenceParallel(), _chunk(x, 1, rank, world_size), 1),
        ("ln_dtensor", nn.LayerNorm(12), i.SequenceParallel(), distribute_tensor(x, mesh, [Shard(1)]), 1),
        ("rms_batch_sharded_dtensor", RMSNorm(12), i.SequenceParallel(), distribute_tensor(x, mesh, [Shard(0)]), 1),
        ("rms_dim0", RMSNorm(12), i.SequenceParallel(sequence_dim=0),
         _chunk(x.transpose(0, 1), 0, rank, world_size), 0),
        ("ln_local_out", nn.LayerNorm(12), i.SequenceParallel(use_local_output=True), _chunk(x, 1, rank, world_size), 1),
    ):
        with torch.no_grad():  # non-trivial affine parameters, equal on every rank
            for p in norm.parameters():
                p.copy_(torch.linspace(0.5, 1.5, p.numel()))
        tp = i.parallelize_module(copy.deepcopy(norm), mesh, style)
        out = tp(inp)
        kinds[key] = (type(out).__name__, tuple(out.placements) if isinstance(out, DTensor) else None)
        ref_in = x.transpose(0, 1) if seq_dim == 0 else x
        want = norm(ref_in)
        want.sum().backward()
        dt = out if isinstance(out, DTensor) else DTensor.from_local(out, mesh, [Shard(seq_dim)], run_check=False)
        dt.full_tensor().sum().backward()
        errs.update(_compare(norm, tp, want, dt, key))
    return errs, kinds


@pytest.mark.parametrize("name", IMPLS)
def test_sequence_parallel_arguments_and_inputs(name):
    for errs, kinds in run_on_workers(_sequence_parallel, WORLD, name, timeout=120):
        bad = {k: e for k, e in errs.items() if not e <= TOL}
        assert not bad, f"{name}: {bad}"
        assert kinds["ln_plain"] == kinds["ln_dtensor"] == kinds["rms_batch_sharded_dtensor"] == ("DTensor", (Shard(1),))
        assert kinds["rms_dim0"] == ("DTensor", (Shard(0),)) and kinds["ln_local_out"] == ("Tensor", None), kinds


class Combine(nn.Module):
    def forward(self, x, scale, *, bias=None):
        return x * scale + (0 if bias is None else bias)


def _prepare(rank, world_size, name):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    x, bias = torch.randn(8, 4), torch.randn(8, 4)
    mine = lambda t: _chunk(t, 0, rank, world_size)  # noqa: E731
    want = x * 3.0 + bias
    out = {}
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"bias": Shard(0)}, desired_input_kwarg_layouts={"bias": Replicate()}))
    got = m(mine(x), 3.0, bias=mine(bias))
    out["input_dtensors"] = (type(got).__name__, rel_err(_full(got), want))
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None), use_local_output=True))
    got = m(mine(x), 3.0)
    out["input_local"] = (type(got).__name__, rel_err(got, x * 3.0))
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    got = m(x, 3.0, bias=bias)
    out["output_local"] = (type(got).__name__, rel_err(got, mine(want)))
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False))
    got = m(x, 3.0, bias=bias)
    out["output_dtensor"] = (type(got).__name__, rel_err(got.full_tensor(), want))
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleInputOutput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=Shard(1)))
    got = m(mine(x), 3.0)
    out["input_output"] = (type(got).__name__, rel_err(got, _chunk(x * 3.0, 1, rank, world_size)))
    # gradients flow back through the layout changes (all-gather forward, reduce-scatter back)
    leaf = mine(x).requires_grad_()
    m = i.parallelize_module(Combine(), mesh, i.PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)))
    (m(leaf, 3.0) ** 2).full_tensor().sum().backward()
    out["input_grad"] = ("Tensor", rel_err(leaf.grad, mine(2 * 9.0 * x)))
    return out


@pytest.mark.parametrize("name", IMPLS)
def test_prepare_module_input_output_arguments(name):
    want_kinds = {"input_dtensors": "DTensor", "input_local": "Tensor", "output_local": "Tensor",
                  "output_dtensor": "DTensor", "input_output": "Tensor", "input_grad": "Tensor"}
    for r in run_on_workers(_prepare, WORLD, name):
        bad = {k: v for k, v in r.items() if v[0] != want_kinds[k] or not v[1] <= TOL}
        assert not bad, f"{name}: {bad}"


def _loss(rank, world_size, name):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    weight = torch.rand(16)
    errs = {}
    for shape, tshape in (((8, 16), (8,)), ((4, 16, 6), (4, 6))):
        x = torch.randn(*shape)
        target = torch.randint(0, 16, tshape)
        target.view(-1)[1] = -100
        for reduction in ("none", "mean", "sum"):
            for w in (None, weight):
                key = f"{len(shape)}d:{reduction}:{'w' if w is not None else '-'}"
                ref_x = x.clone().requires_grad_()
                want = F.cross_entropy(ref_x, target, w, reduction=reduction)
                want.sum().backward()
                dx = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
                with i.loss_parallel():
                    got = F.cross_entropy(dx, target, w, reduction=reduction)
                    got.sum().backward()  # inside the context, as torch requires
                errs[f"{key}:loss"] = rel_err(got.full_tensor(), want.detach())
                errs[f"{key}:grad"] = rel_err(dx.grad.full_tensor(), ref_x.grad)
                errs[f"{key}:placements"] = 0.0 if (got.placements[0].is_replicate()
                                                    and dx.grad.placements == (Shard(1),)) else 1.0
    dx = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
    try:
        with i.loss_parallel():
            F.cross_entropy(dx, torch.zeros(8, dtype=torch.long))
        wrong_dim = "no error"
    except ValueError as exc:
        wrong_dim = str(exc)
    return errs, wrong_dim


@pytest.mark.parametrize("name", IMPLS)
def test_loss_parallel_reductions_weights_and_a_wrongly_sharded_input(name):
    for errs, wrong_dim in run_on_workers(_loss, WORLD, name):
        bad = {k: e for k, e in errs.items() if not e <= TOL}
        assert not bad, f"{name}: {bad}"
        assert "loss_parallel" in wrong_dim, wrong_dim
