"""Differential: the ``fully_shard`` forms torchtitan's default flow uses, on torch's FSDP2 and on
shardwise, both against one process (issue 33):

* a list unit ``fully_shard([model.norm, model.head])`` built on the meta device, then
  ``model.to_empty(device=...)`` over the whole model (which moves the list's modules one at a
  time) and an init by copy or ``load_state_dict(assign=True)``;
* FSDP x TP on meshes built by ``DeviceMesh._unflatten`` from one 1-D world mesh;
* a parameter shared by two units (tied embedding and head) refused, and the documented fix,
  ``fully_shard([embedding, head])``, training as one process does.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from tests._dist import run_on_workers
from tests.compat._adapter import (
    IMPLS, TinyLM, assert_close, assert_losses, batches, build, full_params, impl, reference, shard, train,
)

TOL = 1e-6  # fp32, sums over 4 ranks in another order
WORLD = 4


def _list_unit(i, model: TinyLM, mesh) -> TinyLM:
    """torchtitan's units: each block, then ``[norm, head]`` as one unit, then the root."""
    for b in model.blocks:
        i.fully_shard(b, mesh=mesh)
    i.fully_shard([model.norm, model.head], mesh=mesh)
    i.fully_shard(model, mesh=mesh)
    return model


def _meta_list_unit(rank, world_size, name, style):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = TinyLM()
    _list_unit(i, model, mesh)
    model.to_empty(device="cpu")  # moves norm, then head: the list unit is whole only after both
    ref = build(0)
    params = dict(model.named_parameters())
    sd = {n: distribute_tensor(r.detach(), params[n].device_mesh, params[n].placements)
          for n, r in ref.named_parameters()}
    if style == "copy":
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(sd[n])
    else:  # load_state_dict(assign=True): again one module after the other
        model.load_state_dict(sd, assign=True)
    assert all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in model.parameters()), \
        f"{name}: parameters after to_empty: {[(n, p.device) for n, p in model.named_parameters()]}"
    assert_close(full_params(model), full_params(ref), 0.0, f"{name} {style}: values after init")
    data = batches(3)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data)
    got = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    assert_losses(got, want, TOL, f"{name} meta list unit {style}")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} meta list unit {style}: parameters")
    return got


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("style", ["copy", "assign"])
def test_meta_start_of_a_list_unit(name, style):
    """meta -> per-block units, ``fully_shard([norm, head])``, root -> ``to_empty`` -> init ->
    three AdamW steps equal to one process."""
    run_on_workers(_meta_list_unit, WORLD, name, style, timeout=90)


def _split_list_unit(rank, world_size, how):
    i = impl("shardwise")
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    if how == "meta":
        with torch.device("meta"):
            model = TinyLM()
        _list_unit(i, model, mesh)
        for m in (model.tok, model.blocks, model.norm):  # all but head: the unit [norm, head] in part
            m.to_empty(device="cpu")
    else:
        model = _list_unit(i, build(0), mesh)
        model.norm.to("meta")  # only one module of the unit [norm, head] moved to another device
    try:
        model(batches(1)[0][:, :-1])
    except (ValueError, RuntimeError) as e:
        return str(e)
    raise AssertionError(f"{how}: a forward through a unit only partly moved ran")


@pytest.mark.parametrize("how", ["meta", "to"])
def test_a_list_unit_moved_in_part_is_refused_when_used(how):
    """Only some modules of a list unit moved, then used: one clear error naming the unit
    (shardwise only: torch's per-parameter storage lets the unit run on two devices)."""
    msgs = run_on_workers(_split_list_unit, WORLD, how, timeout=90)
    assert all("fully_shard([LayerNorm, Linear])" in m for m in msgs), msgs
    assert all("several devices" in m and "only some of its modules were moved" in m for m in msgs), msgs


def _unflattened_fsdp_tp(rank, world_size, name):
    i = impl(name)
    data = batches(3)
    ref, want = reference(data, lr=0.1, optim=torch.optim.SGD)
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (2, world_size // 2), ("dp", "tp"))  # torchtitan's ParallelDims
    model = shard(i, build(0), mesh["dp"], mesh["tp"])
    dp_rank = mesh.get_local_rank("dp")
    got = train(model, torch.optim.SGD(model.parameters(), lr=0.1), data, dp_rank, 2)
    assert_losses(got, want, TOL, f"{name} unflattened (dp, tp)")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} unflattened (dp, tp): parameters")
    return got


@pytest.mark.parametrize("name", IMPLS)
def test_fsdp_tp_on_meshes_built_by_unflatten(name):
    """A 2x2 (dp, tp) mesh made by ``world._unflatten`` from a 1-D world mesh: blocks TP'd on
    ``mesh["tp"]``, every unit on ``mesh["dp"]``; SGD steps equal to one process."""
    run_on_workers(_unflattened_fsdp_tp, WORLD, name, timeout=90)


class TiedLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.tok.weight


def _tied(rank, world_size, name, form):
    i = impl(name)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    ref = TiedLM()
    torch.manual_seed(0)
    model = TiedLM()
    for b in model.blocks:
        i.fully_shard(b, mesh=mesh)
    try:
        if form == "separate":
            i.fully_shard(model.tok, mesh=mesh)
            i.fully_shard(model.head, mesh=mesh)
        else:
            i.fully_shard([model.tok, model.head], mesh=mesh)
        i.fully_shard(model, mesh=mesh)
        data = batches(3)
        got = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    except ValueError as e:
        return str(e)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data)
    assert_losses(got, want, TOL, f"{name} tied {form}")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} tied {form}: parameters")
    assert len(list(model.parameters())) == len(list(ref.parameters())), f"{name}: the tie is lost"
    return got


@pytest.mark.parametrize("name", IMPLS)
def test_a_parameter_shared_by_two_units(name):
    """A tied embedding / head sharded as two units is refused with ValueError naming the
    parameter and ``fully_shard([module_a, module_b])`` (torch at the first forward, shardwise
    at the second ``fully_shard``); as one list unit it trains as one process does."""
    msgs = run_on_workers(_tied, WORLD, name, "separate", timeout=90)
    for m in msgs:
        assert "is shared with a parameter already managed by another FSDP group" in m, m
        assert "fully_shard([module_a, module_b])" in m, m
    run_on_workers(_tied, WORLD, name, "list", timeout=90)


def _replicated_on(model, mesh):
    from torch.distributed.tensor import Replicate

    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[pname] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim))
    return model


def _multi_axis(rank, world_size, shape, shard, replicate):
    """dp_mesh_dims naming several axes per role: they are flattened into one (shardwise vs one
    process; torch's dp_mesh_dims cannot run a model fed plain tensors, see test_shard_placement)."""
    from shardwise.composable import DataParallelMeshDims, fully_shard

    data = batches(3)
    ref, want = reference(data)
    names = ("r", "a", "b")[3 - len(shape):]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _replicated_on(build(0), mesh)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    p = next(model.parameters())
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    assert_losses(losses, want, TOL, f"dp_mesh_dims {shard} {replicate}")
    assert_close(full_params(model), full_params(ref), TOL, f"dp_mesh_dims {shard} {replicate}: parameters")
    return p.device_mesh.mesh_dim_names, tuple(type(pl).__name__ for pl in p.placements)


@pytest.mark.parametrize("shape,shard,replicate,want", [
    ((2, 2), ("a", "b"), None, (("a_b",), ("Shard",))),
    ((2, 2, 1), ("a", "b"), "r", (("r", "a_b"), ("Replicate", "Shard"))),
    ((1, 2, 2), "b", ("r", "a"), (("r_a", "b"), ("Replicate", "Shard"))),
])
def test_dp_mesh_dims_flattens_several_axes(shape, shard, replicate, want):
    """``DataParallelMeshDims(shard=("a", "b"))`` shards over one axis ``a_b`` of all their ranks
    (and ``replicate=(...)`` likewise, HSDP): AdamW steps equal to one process."""
    got = run_on_workers(_multi_axis, WORLD, shape, shard, replicate, timeout=90)
    assert all(g == want for g in got), got


def _placement_result(rank, world_size, name, where):
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    i = impl(name)
    data = batches(3)
    ref, want = reference(data)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    other = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("ep", "edp"))["edp"]
    info = FSDPMeshInfo(mesh if where == "unit mesh" else other, shard_mesh_dim=0)

    def fn(p):  # the largest dim that splits evenly (torch 2.13 needs even splits off dim 0)
        dims = [d for d in range(p.dim()) if p.shape[d] % world_size == 0]
        return ShardPlacementResult(Shard(max(dims, key=lambda d: p.shape[d])) if dims else None, info)

    model = build(0)
    try:
        for b in model.blocks:
            i.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
        i.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
    except NotImplementedError as e:
        return str(e)
    dims = sorted({p.placements[0].dim for p in model.parameters()})
    losses = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, rank, world_size)
    assert_losses(losses, want, TOL, f"{name} ShardPlacementResult")
    assert_close(full_params(model), full_params(ref), TOL, f"{name} ShardPlacementResult: parameters")
    return dims


@pytest.mark.parametrize("name", IMPLS)
def test_shard_placement_result_on_the_unit_mesh(name):
    """torch 2.13's ``shard_placement_fn`` returning ``ShardPlacementResult(Shard(d), mesh_info)``
    on the unit's mesh: the placements it names, AdamW steps equal to one process."""
    dims = run_on_workers(_placement_result, WORLD, name, "unit mesh", timeout=90)
    assert all(d == dims[0] for d in dims) and len(dims[0]) > 1, f"{name}: shard dims used {dims}"


def test_shard_placement_result_on_another_mesh_is_refused():
    """A parameter on a mesh of its own (torch 2.13 makes a second group in the unit): shardwise
    refuses it, naming the parameter and the nested-unit form (not yet supported)."""
    msgs = run_on_workers(_placement_result, WORLD, "shardwise", "other mesh", timeout=90)
    assert all("on its own mesh" in m and "fully_shard(moe.experts" in m for m in msgs), msgs
