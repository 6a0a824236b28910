"""Differential: ``parallelize_module``'s arguments and plans, torch's TP vs shardwise's.

Every scenario runs once per implementation on 4 persistent gloo workers and is checked against
the same single-process reference: the mesh from ``with mesh:``, no plan, ``src_data_rank`` (0,
1, None), fqn wildcards (``*``, ``?``, ``[..]``, several levels), a plan entry naming a missing
module, the root entry ``""``, a user style written to torch's ``_apply`` protocol, and the
exception types torch raises for bad input.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from tests._compare import maxerr
from tests._dist import run_on_workers
from tests.compat._adapter import IMPLS, Impl, impl, rel_err

WORLD = 4
TOL = 1e-6


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _step_errors(ref: nn.Module, tp: nn.Module, x_ref: torch.Tensor, x_tp: torch.Tensor) -> dict[str, float]:
    """Forward, backward and one SGD step on both; relative errors of output, grads, params."""
    errs = {}
    out_ref, out_tp = ref(x_ref), tp(x_tp)
    errs["out"] = rel_err(_full(out_tp), out_ref.detach())
    out_ref.sum().backward()
    (out_tp.full_tensor() if isinstance(out_tp, DTensor) else out_tp).sum().backward()
    for opt in (torch.optim.SGD(ref.parameters(), lr=0.25), torch.optim.SGD(tp.parameters(), lr=0.25)):
        opt.step()
    grads = dict(ref.named_parameters())
    for n, p in tp.named_parameters():
        errs[f"param:{n}"] = rel_err(_full(p), grads[n].detach())
    return errs


def _mesh(world_size: int):
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


def _plans(rank, world_size, name):
    i = impl(name)
    col, row = i.ColwiseParallel, i.RowwiseParallel
    mesh = _mesh(world_size)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    out: dict[str, object] = {}
    cases = {
        "pairs": (MLP, {"net1": col(), "net2": row()}),
        "star": (MLP, {"net*": col(output_layouts=Replicate())}),
        "question": (MLP, {"net?": col(output_layouts=Replicate())}),
        "brackets": (MLP, {"net[1-2]": col(output_layouts=Replicate())}),
        "two_levels": (Stack, {"layers.*.net[1]": col(), "layers.*.net[2]": row()}),
    }
    for key, (cls, plan) in cases.items():
        torch.manual_seed(1)
        ref = cls()
        tp = i.parallelize_module(copy.deepcopy(ref), mesh, plan)
        out[key] = max(_step_errors(ref, tp, x, x).values())
    # the mesh from `with mesh:`, the plan by keyword
    torch.manual_seed(1)
    ref = MLP()
    with mesh:
        tp = i.parallelize_module(copy.deepcopy(ref), parallelize_plan={"net1": col(), "net2": row()})
    out["with_mesh"] = max(_step_errors(ref, tp, x, x).values())
    # the root entry "": lay out the whole module's input and output
    torch.manual_seed(1)
    ref = MLP()
    root = i.PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(0),
                                      output_layouts=Shard(0), desired_output_layouts=Replicate())
    tp = i.parallelize_module(copy.deepcopy(ref), mesh, {"": root, "net1": col(input_layouts=Shard(0)),
                                                          "net2": row(output_layouts=Shard(0))})
    out["root_entry"] = max(_step_errors(ref, tp, x, x).values())
    # a plan entry naming a missing module: warned and skipped, the rest applied
    torch.manual_seed(1)
    ref = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp = i.parallelize_module(copy.deepcopy(ref), mesh, {"net0.hello": col(), "net1": col(),
                                                              "net2": row(), "net3": col()})
    out["missing_warns"] = sum(issubclass(w.category, UserWarning) for w in caught)
    out["missing"] = max(_step_errors(ref, tp, x, x).values())
    return out


@pytest.mark.parametrize("name", IMPLS)
def test_plans_wildcards_root_entry_and_mesh_from_context(name):
    for r in run_on_workers(_plans, WORLD, name, timeout=120):
        errs = {k: v for k, v in r.items() if k != "missing_warns"}
        assert all(e <= TOL for e in errs.values()), f"{name}: {errs}"
        assert r["missing_warns"] >= 2, f"{name}: two missing entries, {r['missing_warns']} warnings"


def _no_plan_no_mesh(rank, world_size, name):
    i = impl(name)
    mesh = _mesh(world_size)
    m = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = i.parallelize_module(m, mesh)
    no_plan = (back is m, [w.category.__name__ for w in caught if issubclass(w.category, UserWarning)],
               any(isinstance(p, DTensor) for p in m.parameters()))
    try:
        i.parallelize_module(MLP(), parallelize_plan={"net1": i.ColwiseParallel()})
        no_mesh = "no error"
    except RuntimeError as exc:
        no_mesh = f"RuntimeError: {exc}"
    return no_plan, no_mesh


@pytest.mark.parametrize("name", IMPLS)
def test_no_plan_warns_and_returns_the_module_and_no_mesh_is_a_runtime_error(name):
    for (same, warned, distributed), no_mesh in run_on_workers(_no_plan_no_mesh, WORLD, name):
        assert same and len(warned) == 1 and not distributed, (same, warned, distributed)
        assert no_mesh.startswith("RuntimeError"), no_mesh


def _src_data_rank(rank, world_size, name):
    i = impl(name)
    mesh = _mesh(world_size)
    out = {}
    for src in (0, 1, None):
        torch.manual_seed(100 + rank)  # every rank starts from different values
        mine = MLP()
        with CommDebugMode() as comm:
            tp = i.parallelize_module(copy.deepcopy(mine), mesh, {"net1": i.ColwiseParallel(),
                                                                   "net2": i.RowwiseParallel()},
                                      src_data_rank=src)
        if src is None:  # each rank's own slice: the local shards are pieces of this rank's values
            want = {n: distribute_tensor(p.detach(), mesh, tp.get_parameter(n).placements,
                                         src_data_rank=None).to_local() for n, p in mine.named_parameters()}
            got = {n: p.to_local() for n, p in tp.named_parameters()}
        else:  # the source rank's values, on every rank
            torch.manual_seed(100 + src)
            want = dict(MLP().named_parameters())
            got = {n: p.full_tensor() for n, p in tp.named_parameters()}
        out[str(src)] = (maxerr(rel_err(got[n], want[n].detach()) for n in want), comm.get_total_counts())
    return out


@pytest.mark.parametrize("name", IMPLS)
def test_src_data_rank_picks_the_source_or_none_keeps_local_values_without_communication(name):
    for r in run_on_workers(_src_data_rank, WORLD, name):
        assert all(err == 0.0 for err, _ in r.values()), r
        assert r["0"][1] > 0 and r["1"][1] > 0 and r["None"][1] == 0, r


def _torch_protocol_style(rank, world_size, name):
    i = impl(name)

    class ReplicateAll(i.ParallelStyle):  # a user style written to torch's protocol
        def _apply(self, module, device_mesh):
            for n, p in list(module.named_parameters()):
                module.register_parameter(n, nn.Parameter(
                    distribute_tensor(p.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank)))
            return module

    torch.manual_seed(200 + rank)
    m = i.parallelize_module(nn.Linear(4, 4), _mesh(world_size), ReplicateAll(), src_data_rank=2)
    torch.manual_seed(202)
    want = nn.Linear(4, 4)
    return rel_err(m.weight.to_local(), want.weight.detach()), type(m.weight).__name__


@pytest.mark.parametrize("name", IMPLS)
def test_a_user_style_with_torchs_apply_protocol_sees_src_data_rank(name):
    for err, kind in run_on_workers(_torch_protocol_style, WORLD, name):
        assert err == 0.0 and kind == "DTensor", (err, kind)


def _errors(rank, world_size, name):
    i = impl(name)
    mesh = _mesh(world_size)
    out = {}

    def kind(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  the type is what is compared
            return [c.__name__ for c in type(exc).__mro__]
        return ["no error"]

    out["plan_type"] = kind(lambda: i.parallelize_module(MLP(), mesh, [i.ColwiseParallel()]))
    out["no_rule"] = kind(lambda: i.parallelize_module(nn.LayerNorm(4), mesh, i.ColwiseParallel()))
    out["lengths"] = kind(lambda: i.PrepareModuleInput(input_layouts=Shard(0),
                                                       desired_input_layouts=(Replicate(), None)))
    out["out_lengths"] = kind(lambda: i.PrepareModuleOutput(output_layouts=(Shard(0), None),
                                                            desired_output_layouts=Replicate()))
    m = i.parallelize_module(nn.Identity(), mesh, i.PrepareModuleInput(input_layouts=(Shard(0), None),
                                                                       desired_input_layouts=(Replicate(), None)))
    out["input_count"] = kind(lambda: m(torch.ones(2, 4)))
    n = i.parallelize_module(nn.Identity(), mesh, i.PrepareModuleOutput(output_layouts=(Shard(0), None),
                                                                        desired_output_layouts=(Replicate(), None)))
    out["output_count"] = kind(lambda: n(torch.ones(2, 4)))
    return out


@pytest.mark.parametrize("name", IMPLS)
def test_bad_input_raises_torchs_exception_types(name):
    want = {"plan_type": "TypeError", "no_rule": "NotImplementedError", "lengths": "AssertionError",
            "out_lengths": "AssertionError", "input_count": "ValueError", "output_count": "ValueError"}
    for r in run_on_workers(_errors, WORLD, name):
        bad = {k: r[k] for k, t in want.items() if t not in r[k]}
        assert not bad, f"{name}: {bad}"
