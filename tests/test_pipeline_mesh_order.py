"""Pipelines on meshes whose ``pp`` axis sits anywhere: a checkpoint of ``pp=2 x dp=2`` saved on
a ``("dp", "pp")`` mesh (pp inner: a stage's ranks are 0 and 2) and on a ``("pp", "dp")`` one
(pp outer: 0 and 1) round-trips bit-exactly, model and optimizer, into the same layout, the
other layout and one process, with the stages sharded over ``dp`` or plain. Before stage ranks
came from the mesh (they were taken as consecutive global ranks), ``("dp", "pp")`` saved wrong
bytes for the plain tensors (the optimizer's ``step`` under ``fully_shard``; measured by
reverting the fix) or failed with a bare IndexError."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise.checkpoint as ckpt
import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from shardwise.mesh import mesh_axes, pipeline_mesh
from tests._dist import run_ranks

CFG = LlamaConfig(vocab_size=17, dim=16, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _model(names, seed, fsdp=True):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    split = sw.pipeline_split(Llama(CFG, generator=torch.Generator().manual_seed(seed)), pipeline_mesh(mesh),
                              cost="params", verbose=False)
    for st in split.stages if fsdp else ():  # without: plain tensors, replicated over dp
        for b in st.blocks:
            sw.fully_shard(b, mesh=mesh["dp"])
        sw.fully_shard(st.module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(split.module.parameters(), lr=1e-2)
    return mesh, split, opt


def _save(rank, world_size, names, path, fsdp):
    mesh, split, opt = _model(names, 0, fsdp)
    sched = sw.PipelineSchedule(split, schedule="1f1b", microbatches=2, loss_fn=_ce)
    tokens = torch.randint(0, CFG.vocab_size, (8, 8), generator=torch.Generator().manual_seed(1))
    r = mesh["dp"].get_local_rank() if fsdp else 0  # plain replicas train on the same data
    sched.step(tokens[r * 4:(r + 1) * 4, :-1], tokens[r * 4:(r + 1) * 4, 1:])
    opt.step()
    ckpt.save({"model": sw.pipeline_state_dict(split), "optim": sw.pipeline_optimizer_state_dict(split, opt)}, path)
    optim = {f"{n}/{k}": _full(v) for n, st in sw.pipeline_optimizer_state_dict(split, opt)["state"].items()
             for k, v in st.items() if isinstance(v, torch.Tensor) and (not isinstance(v, DTensor)
                                                                        or v.device_mesh.get_coordinate() is not None)}
    return {n: _full(p) for n, p in split.module.named_parameters()}, optim, split.stage_ranks


def _load(rank, world_size, names, path, fsdp):
    mesh, split, opt = _model(names, 7, fsdp)  # other weights: the load must set them all
    sched = sw.PipelineSchedule(split, schedule="1f1b", microbatches=2, loss_fn=_ce)
    tokens = torch.randint(0, CFG.vocab_size, (8, 8), generator=torch.Generator().manual_seed(2))
    r = mesh["dp"].get_local_rank() if fsdp else 0  # plain replicas train on the same data
    sched.step(tokens[r * 4:(r + 1) * 4, :-1], tokens[r * 4:(r + 1) * 4, 1:])
    opt.step()  # optimizer state exists, and differs from the saved one
    state = {"model": sw.pipeline_state_dict(split), "optim": sw.pipeline_optimizer_state_dict(split, opt)}
    ckpt.load(state, path)
    sw.set_pipeline_state_dict(split, state["model"])
    sw.set_pipeline_optimizer_state_dict(split, opt, state["optim"])
    optim = {f"{n}/{k}": _full(v) for n, st in sw.pipeline_optimizer_state_dict(split, opt)["state"].items()
             for k, v in st.items() if isinstance(v, torch.Tensor) and (not isinstance(v, DTensor)
                                                                        or v.device_mesh.get_coordinate() is not None)}
    return {n: _full(p) for n, p in split.module.named_parameters()}, optim


def _load_one_process(rank, world_size, path):
    model = Llama(CFG, generator=torch.Generator().manual_seed(5))
    state = {"model": ckpt.get_model_state_dict(model)}
    ckpt.load(state, path)
    ckpt.set_model_state_dict(model, state["model"])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _merge(parts):
    out = {}
    for p in parts:
        out.update(p)
    return out


@pytest.mark.parametrize(("names", "fsdp"), [(("dp", "pp"), True), (("pp", "dp"), True), (("dp", "pp"), False)])
def test_pipeline_checkpoint_round_trips_with_pp_inner_or_outer(tmp_path, names, fsdp):
    path = str(tmp_path / "ck")
    saved = run_ranks(_save, 4, names, path, fsdp, timeout=120)
    grid = torch.arange(4).reshape(2, 2)
    pp_dim = names.index("pp")
    for rank, (_, _, stage_ranks) in enumerate(saved):
        coord = (grid == rank).nonzero()[0].tolist()
        want = grid.select(pp_dim, coord[pp_dim]).flatten().tolist()
        assert list(stage_ranks) == want, (names, rank, stage_ranks, want)
    params, optim = _merge(s[0] for s in saved), _merge(s[1] for s in saved)
    assert set(params) == {n for n, _ in Llama(CFG).named_parameters()}
    other = ("pp", "dp") if names == ("dp", "pp") else ("dp", "pp")
    for layout in (names, other):
        loaded = run_ranks(_load, 4, layout, path, fsdp, timeout=120)
        got_p, got_o = _merge(p for p, _ in loaded), _merge(o for _, o in loaded)
        assert set(got_p) == set(params) and set(got_o) == set(optim) and optim, (layout, sorted(set(got_o) ^ set(optim)))
        for n in params:
            assert torch.equal(got_p[n], params[n]), f"{names} -> {layout}: parameter {n} differs"
        for k in optim:
            assert torch.equal(got_o[k], optim[k]), f"{names} -> {layout}: optimizer state {k} differs"
    (one,) = run_ranks(_load_one_process, 1, path, timeout=60)
    for n in params:
        assert torch.equal(one[n], params[n]), f"{names} -> one process: {n} differs"


def _views(rank, world_size):
    out = {}
    for names in (("dp", "pp"), ("pp", "dp")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        axes = mesh_axes(mesh, "pp", "dp")
        pp = pipeline_mesh(mesh)
        try:
            both = axes.sub("pp", "dp").mesh_dim_names
        except ValueError as exc:
            both = str(exc)
        out[names] = (axes.size("pp"), axes.coordinate("pp"), axes.peers("pp"), pp.mesh.tolist(), both,
                      axes.size("tp"))
    try:
        mesh_axes(mesh, "pp", "tp", caller="here")
    except ValueError as exc:
        out["missing"] = str(exc)
    try:
        mesh_axes("pp", "pp", caller="here")
    except TypeError as exc:
        out["type"] = str(exc)
    return out


def test_mesh_axes_finds_axes_by_name_in_any_order():
    for rank, got in enumerate(run_ranks(_views, 4, timeout=60)):
        dp_pp, pp_dp = got[("dp", "pp")], got[("pp", "dp")]
        # ("dp", "pp"): [[0, 1], [2, 3]], pp varies along a row; ("pp", "dp"): pp varies along a column
        assert dp_pp[:4] == (2, rank % 2, (rank % 2, rank % 2 + 2), [rank // 2 * 2, rank // 2 * 2 + 1]), dp_pp
        assert pp_dp[:4] == (2, rank // 2, (rank // 2 * 2, rank // 2 * 2 + 1), [rank % 2, rank % 2 + 2]), pp_dp
        assert pp_dp[4] == ("pp", "dp") and dp_pp[5] == 1
        assert dp_pp[4].startswith("the mesh has axes ('dp', 'pp'); the sub-mesh ('pp', 'dp') needs them"), dp_pp[4]
        assert got["missing"].startswith("here: the mesh has axes ('pp', 'dp') but lacks ['tp']"), got["missing"]
        assert got["type"].startswith("here: expected a torch DeviceMesh"), got["type"]
