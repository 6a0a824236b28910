"""fully_shard against a single-process reference on real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.composable import FSDPModule, fully_shard
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import make_mesh, max_param_error, reference_and_copy, train_pair

TOL = 1e-6  # fp32, relative; sums over ranks reorder additions (~1e-7 observed)


def _shard_all(model, mesh, reshard_after_forward=None):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


def _parity(rank, world_size, mesh_shape, reshard_after_forward):
    mesh = make_mesh(mesh_shape)
    ref, model = reference_and_copy()
    _shard_all(model, mesh, reshard_after_forward)
    placements = (Shard(0),) if len(mesh_shape) == 1 else (Replicate(), Shard(0))
    shard_world = mesh_shape[-1]
    shard_rank = mesh.get_local_rank(mesh.ndim - 1)
    for name, p in model.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and isinstance(p, DTensor), name
        assert tuple(p.placements) == placements, (name, p.placements)
        chunks = torch.empty(p.shape).chunk(shard_world)
        want = chunks[shard_rank].shape if shard_rank < len(chunks) else (0, *p.shape[1:])
        assert p.to_local().shape == want, (name, p.to_local().shape, want)
    loss_err = train_pair(ref, model, rank, world_size, steps=3)
    errs = max_param_error(ref, model)
    for name, p in model.named_parameters():
        assert isinstance(p.grad, type(None)), "zero_grad(set_to_none) cleared the DTensor grads"
    return loss_err, errs


@pytest.mark.parametrize(
    "world_size,mesh_shape,raf",
    [
        (1, (1,), None),
        (2, (2,), None),
        (4, (4,), None),
        (4, (2, 2), None),
        (2, (2,), False),
        (4, (4,), 2),
        (4, (2, 2), 2),
    ],
    ids=["fsdp1", "fsdp2", "fsdp4", "hsdp2x2", "zero2-w2", "fsdp4-raf2", "hsdp2x2-raf2"],
)
def test_training_matches_single_process(world_size, mesh_shape, raf):
    results = run_ranks(_parity, world_size, mesh_shape, raf, timeout=90)
    for rank, (loss_err, errs) in enumerate(results):
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference: {bad}"


def _tokens(rank):
    return torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))


def _grads_are_dtensors(rank, world_size):
    """Each rank's *local* gradient shard against the same rows of a single-process reference
    gradient (no collective in the comparison: ``full_tensor()`` would be equal on every rank by
    construction). Rank r's loss is ``model(tokens_r).sum()``; fully_shard averages over ranks,
    so the reference is the gradient of the mean of those losses."""
    mesh = make_mesh((world_size,))
    ref, model = reference_and_copy()
    _shard_all(model, mesh)
    model(_tokens(rank)).sum().backward()
    (sum(ref(_tokens(r)).sum() for r in range(world_size)) / world_size).backward()
    ref_grads = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name}: grad is {type(p.grad).__name__}, not a DTensor"
        assert p.grad.placements == p.placements and p.grad.shape == p.shape, \
            f"{name}: grad {p.grad.placements} {tuple(p.grad.shape)} vs param {p.placements} {tuple(p.shape)}"
        assert p.grad.to_local().shape == p.to_local().shape, f"{name}: local grad / param shapes differ"
        want = ref_grads[name].grad
        chunks = want.chunk(world_size)
        want = chunks[rank] if rank < len(chunks) else want[:0]
        errs[name] = ((p.grad.to_local() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() \
            if want.numel() else float(p.grad.to_local().numel())
    # after backward every unit is resharded: the modules hold the sharded parameters again
    assert all(isinstance(p, DTensor) for p in model.parameters()), "a unit stayed unsharded after backward"
    return errs


def test_gradients_are_sharded_dtensors_equal_to_the_reference():
    for rank, errs in enumerate(run_ranks(_grads_are_dtensors, 2)):
        bad = {n: e for n, e in errs.items() if not e <= TOL}
        assert not bad, f"rank {rank}: local gradient shards differ from the reference rows: {bad}"


def _state_dict_round_trip(rank, world_size):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    _shard_all(model, mesh)
    calls = []
    real = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")}
    for n, f in real.items():
        setattr(dist, n, lambda *a, _n=n, _f=f, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        sd = model.state_dict()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    assert not calls, f"state_dict() communicated: {calls}"
    assert all(isinstance(v, DTensor) for v in sd.values()), "state_dict holds the sharded DTensors"
    saved = {k: v.to_local().clone() for k, v in sd.items()}
    snapshot = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    model.load_state_dict(snapshot)
    for k, v in model.state_dict().items():
        assert torch.equal(v.to_local(), saved[k]), k
    # the loaded values are what the next all-gather sees
    model.unshard()
    ok = torch.equal(model.head.weight.detach(), snapshot["head.weight"].full_tensor())
    model.reshard()
    return ok


def test_state_dict_is_sharded_without_communication_and_loads_back():
    assert run_ranks(_state_dict_round_trip, 2) == [True, True]


def _mixin(rank, world_size):
    _, model = reference_and_copy()
    _shard_all(model, make_mesh((world_size,)))
    _, fresh = reference_and_copy()
    return (isinstance(model.blocks[0], FSDPModule), type(model.blocks[0]).__name__,
            isinstance(model, FSDPModule), isinstance(fresh.blocks[0], FSDPModule))


def test_fsdp_module_mixin_is_added_per_instance():
    assert run_ranks(_mixin, 1) == [(True, "FSDPBlock", True, False)]


def _record_collectives(rank, world_size, mesh_shape, raf):
    mesh = make_mesh(mesh_shape)
    _, model = reference_and_copy()
    _shard_all(model, mesh, raf)
    log = []
    names = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    real = {n: getattr(dist, n) for n in names}

    def spy(name, fn):
        def wrapped(out, *args, group=None, **kw):
            log.append((name, out.numel() * out.element_size() if name != "reduce_scatter_single" else args[0].numel() * 4,
                        dist.get_world_size(group)))
            return fn(out, *args, group=group, **kw)
        return wrapped

    for n, f in real.items():
        setattr(dist, n, spy(n, f))
    try:
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))
        model(tokens).sum().backward()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return log


def _unit_bytes(modules, shard_world):
    """Bytes of one unit's all-gather output, from ``torch.chunk`` (not the library's formula):
    every rank sends its parameters' largest chunk (fp32), padded shards being equal-sized."""
    total = 0
    for m in modules:
        for p in m.parameters(recurse=False):
            largest = max(c.numel() for c in torch.empty(p.shape).chunk(shard_world))
            total += largest * shard_world * 4
    return total


@pytest.mark.parametrize("world_size,mesh_shape,raf", [(4, (4,), None), (4, (2, 2), None), (4, (4,), 2), (2, (2,), False)])
def test_one_all_gather_per_unshard_and_one_reduce_scatter_per_backward(world_size, mesh_shape, raf):
    _, probe = reference_and_copy()
    W = mesh_shape[-1]
    R = mesh_shape[0] if len(mesh_shape) == 2 else 1
    root = _unit_bytes([probe, probe.emb, probe.head], W)
    block = _unit_bytes(list(probe.blocks[0].modules()), W)
    ag_group = W if raf is None else raf
    forward = [("all_gather_single", root, W), ("all_gather_single", block, W), ("all_gather_single", block, W)]
    backward = [] if raf is False else [("all_gather_single", block, ag_group)] * 2
    # plus one fp32 used-flag per trainable parameter in every rank's row ([Note: unused
    # parameters] in _reduce.py): 6 parameters per block, 4 in the root (emb, head w/b, scale)
    units = [(block, 6 * 4), (block, 6 * 4), (root, 4 * 4)]  # (bytes, flag bytes per row)
    scatters = [("reduce_scatter_single", unit + flags * W, W) for unit, flags in units]
    all_reduces = [("all_reduce", unit // W + flags, R) for unit, flags in units] if R > 1 else []
    # padding is bounded: each parameter of W * c rows (c = ceil(n / W)) pads fewer than W rows
    n_block = sum(p.numel() for p in probe.blocks[0].parameters()) * 4
    pad_bound = sum(W * 4 * math.prod(p.shape[1:]) for p in probe.blocks[0].parameters())
    for rank, log in enumerate(run_ranks(_record_collectives, world_size, mesh_shape, raf)):
        gathers = [e for e in log if e[0].startswith("all_gather")]
        sent = gathers[1][1]  # the library's all-gather of block 0, in bytes
        assert n_block <= sent < n_block + pad_bound, f"rank {rank}: block all-gather {sent} B for {n_block} B"
        assert gathers == forward + backward, f"rank {rank}: all-gathers {gathers}"
        got = [e for e in log if e[0].startswith("reduce_scatter")]
        assert got == scatters, f"rank {rank}: reduce-scatters {got}"
        got = [e for e in log if e[0] == "all_reduce"]
        assert got == all_reduces, f"rank {rank}: all-reduces {got}"


def _errors(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = make_mesh((world_size,))
    found = {}

    def expect(key, fn, *needles):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            msg = str(e)
            missing = [n for n in needles if n not in msg]
            found[key] = "ok" if not missing else f"message lacks {missing}: {msg}"
        else:
            found[key] = "no error raised"

    _, model = reference_and_copy()
    fully_shard(model.blocks[0], mesh=mesh)
    expect("twice", lambda: fully_shard(model.blocks[0], mesh=mesh), "already sharded", "Block")

    # an embedding tied to the head, with the embedding in its own unit
    _, tied = reference_and_copy(out=11)
    tied.head.weight = tied.emb.weight
    fully_shard(tied.emb, mesh=mesh)
    expect("tied", lambda: fully_shard(tied, mesh=mesh), "'head.weight'", "'weight' of the unit fully_shard(Embedding)",
           "common ancestor")

    ints = torch.nn.Linear(2, 2)
    ints.register_parameter("count", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    expect("int", lambda: fully_shard(ints, mesh=mesh), "'count'", "int64", "register_buffer")

    scalar = torch.nn.Linear(2, 2)
    scalar.temperature = torch.nn.Parameter(torch.tensor(1.0))
    expect("0-d", lambda: fully_shard(scalar, mesh=mesh), "'temperature'", "0-d", "ignored_params")

    mesh3 = init_device_mesh("cpu", (1, 1, world_size))
    expect("3d-unnamed", lambda: fully_shard(torch.nn.Linear(2, 2), mesh=mesh3), "without axis names", "data_parallel_mesh",
           "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh")
    named3 = init_device_mesh("cpu", (1, world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    expect("3d-named", lambda: fully_shard(torch.nn.Linear(2, 2), mesh=named3), "('dp_replicate', 'dp_shard', 'tp')",
           "mesh['dp_replicate', 'dp_shard']")
    expect("raf", lambda: fully_shard(torch.nn.Linear(2, 2), mesh=mesh, reshard_after_forward=3), "divide")

    # ignored parameters stay plain tensors
    lin = torch.nn.Linear(4, 4)
    fully_shard(lin, mesh=mesh, ignored_params=[lin.bias])
    found["ignored"] = "ok" if (isinstance(lin.weight, DTensor) and not isinstance(lin.bias, DTensor)) else "bias sharded"
    return found


def test_bad_input_gets_a_clear_error():
    (found,) = run_ranks(_errors, 1)
    bad = {k: v for k, v in found.items() if v != "ok"}
    assert not bad, bad


def test_mesh_device_type_must_match_parameters():
    """Parameters on an accelerator with a CPU mesh are refused (CPU parameters would move to an
    accelerator mesh's device). No accelerator here, so the parameter is a stand-in."""
    from types import SimpleNamespace

    from shardwise.composable._fsdp._fully_shard import _check_params

    on_cuda = SimpleNamespace(
        is_floating_point=lambda: True, dim=lambda: 1, device=torch.device("cuda", 0), dtype=torch.float32
    )
    with pytest.raises(ValueError, match=r"'w' is on device 'cuda' but the mesh is 'cpu'.*module.to\('cpu'\)"):
        _check_params([("w", on_cuda, [])], SimpleNamespace(device_type="cpu"), "Linear")


def _grad_accumulation(rank, world_size, mesh_shape):
    from tests._models import batches, loss_fn

    mesh = make_mesh(mesh_shape)
    ref, model = reference_and_copy()
    _shard_all(model, mesh)
    (tokens, target), = batches(1, 8)
    loss_fn(ref(tokens), target).backward()
    per = 8 // world_size
    mine = slice(rank * per, (rank + 1) * per)
    rs_calls = []
    real = dist.reduce_scatter_single
    dist.reduce_scatter_single = lambda *a, **k: (rs_calls.append(1), real(*a, **k))[1]
    try:
        for i, half in enumerate((slice(0, per // 2), slice(per // 2, per))):
            model.set_requires_gradient_sync(i == 1)
            t, y = tokens[mine][half], target[mine][half]
            (loss_fn(model(t), y) / 2).backward()
            if i == 0:
                assert not rs_calls, "no reduce-scatter while gradient sync is off"
                assert all(p.grad is None for p in model.parameters()), "sharded grads appear only after sync"
    finally:
        dist.reduce_scatter_single = real
    assert len(rs_calls) == 3, f"one reduce-scatter per unit on the last micro-batch, got {len(rs_calls)}"
    ref_grads = dict(ref.named_parameters())
    return {n: ((p.grad.full_tensor() - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size,mesh_shape", [(2, (2,)), (4, (2, 2))])
def test_gradient_accumulation_matches_one_large_batch(world_size, mesh_shape):
    for rank, errs in enumerate(run_ranks(_grad_accumulation, world_size, mesh_shape)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def _async_unshard(rank, world_size):
    mesh = make_mesh((world_size,))
    _, model = reference_and_copy()
    _shard_all(model, mesh)
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    handle.wait()
    full = block.up.weight
    ok = not isinstance(full, DTensor) and full.shape == (7, 6)
    block.reshard()
    return ok and isinstance(block.up.weight, DTensor)


def test_unshard_async_handle_and_reshard():
    assert run_ranks(_async_unshard, 2) == [True, True]
