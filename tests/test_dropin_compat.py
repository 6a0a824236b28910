"""What ``composable/_compat.py`` relies on in the installed torch: if an upgrade changes one of
these, this file fails first (and names the helper to adapt)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardwise.composable._compat import (
    TorchDispatchMode,
    backward_running,
    concatenate_meshes,
    flatten_mesh,
    foreach_mul_,
    foreach_norm,
    is_strided_shard,
    queue_backward_callback,
    local_tensor,
    root_mesh,
    run_eagerly,
    set_local_tensor,
    storage_key,
    storage_shared,
    strided_shard,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from tests._dist import run_ranks
from tests._models import make_mesh


def _local_and_root(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = make_mesh((world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False))
    new = torch.arange(6.0).view(2, 3)
    set_local_tensor(p, new)
    ok_local = p.to_local().data_ptr() == new.data_ptr() and torch.equal((p * 2).to_local(), new * 2)
    ok_local = ok_local and local_tensor(p) is new  # the object itself, not a new Parameter over it
    ok_full = torch.equal(p.full_tensor()[2 * rank : 2 * rank + 2], new)
    m2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    return ok_local, ok_full, root_mesh(m2["b"]) is m2, root_mesh(m2) is m2


def test_set_local_tensor_local_tensor_and_root_mesh():
    for got in run_ranks(_local_and_root, 2):
        assert got == (True, True, True, True), got


def _concatenated(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    named = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    unflat = flat._unflatten(0, (2, world // 2), ("dp", "tp"))
    for m in (named, unflat):
        both = concatenate_meshes([m["dp"], m["tp"]])
        out.append((both.mesh_dim_names, both.mesh.tolist(), both == m,
                    [dist.get_process_group_ranks(both.get_group(a)) == dist.get_process_group_ranks(m.get_group(a))
                     for a in ("dp", "tp")]))
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))._unflatten(0, (2, world // 2), ("dp", "tp"))
    try:  # the same ranks by value: one mesh
        concatenate_meshes([unflat["dp"], other["tp"]])
        out.append("equal meshes concatenate")
    except RuntimeError as e:
        out.append(f"refused: {e}")
    try:
        concatenate_meshes([unflat["dp"], unflat["dp"]])
        out.append("overlap accepted")
    except RuntimeError:
        out.append("overlap refused")
    flat2 = flatten_mesh(named[("dp", "tp")], "dp_tp")
    out.append((flat2.mesh_dim_names, flat2.mesh.tolist(), dist.get_process_group_ranks(flat2.get_group()),
                flatten_mesh(named[("dp", "tp")], "dp_tp") == flat2))
    return out


def test_concatenate_and_flatten_meshes():
    """The ``(dp, tp)`` mesh from the two slices of one mesh, built by name or by ``_unflatten``
    (whose root, the world mesh, has neither name); overlapping meshes are refused. Two axes
    flattened into one over all their ranks, the same axis when asked again."""
    for got in run_ranks(_concatenated, 4):
        for names, ranks, equal, groups in got[:2]:
            assert names == ("dp", "tp") and ranks == [[0, 1], [2, 3]] and equal and groups == [True, True], got
        assert got[2:4] == ["equal meshes concatenate", "overlap refused"], got
        assert got[4] == (("dp_tp",), [0, 1, 2, 3], [0, 1, 2, 3], True), got


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


def _strided(rank, world):
    # FSDP (axis "dp") over a TP-sharded dim 0 (axis "tp"): rows are "tp chunk first, then dp
    # chunk within it". full_tensor() must reassemble the global tensor from such pieces.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(8.0 * 3).view(8, 3)
    dp, tp = mesh.get_coordinate()
    local = full[tp * 4 : tp * 4 + 4][dp * 2 : dp * 2 + 2]
    placement = strided_shard(0, 2)
    d = DTensor.from_local(local, mesh, [placement, Shard(0)], run_check=False)
    return (is_strided_shard(placement), is_strided_shard(Shard(0)), torch.equal(d.full_tensor(), full))


def test_strided_shard_places_rows_within_the_later_axis_chunks():
    for got in run_ranks(_strided, 4):
        assert got == (True, False, True), f"strided_shard placement / full_tensor changed: {got}"


def test_queue_backward_callback_runs_after_backward():
    events = []
    x = torch.ones(3, requires_grad=True)

    def hook(g):
        events.append("hook")
        queue_backward_callback(lambda: events.append(("callback", x.grad is not None)))
        return g

    y = (x * 2)
    y.register_hook(hook)
    y.sum().backward()
    # the callback runs once, after every gradient of this backward is accumulated
    assert events == ["hook", ("callback", True)], events


def test_backward_running_is_true_only_inside_a_backward():
    from torch.utils.checkpoint import checkpoint

    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    # inside: a tensor hook, a queued callback, a non-reentrant checkpoint's recomputation
    y.register_hook(lambda g: seen.append(("hook", backward_running())) or
                    queue_backward_callback(lambda: seen.append(("callback", backward_running()))))
    z = checkpoint(lambda t: (seen.append(("forward", backward_running())), t.sin())[1], y, use_reentrant=False)
    z.sum().backward()
    seen.append(("after", backward_running()))
    # after a backward that raised, nothing is running any more
    def raising(g):
        raise RuntimeError("boom")

    w = x * 3
    w.register_hook(raising)
    try:
        w.sum().backward()
    except RuntimeError:
        pass
    seen.append(("after raise", backward_running()))
    assert seen == [("forward", False), ("forward", True), ("hook", True), ("callback", True), ("after", False),
                    ("after raise", False)], seen


def test_storage_key_names_one_storage_through_views_and_resizes():
    a = torch.zeros(4, 3)
    b = torch.zeros(4, 3)
    view = a[1:].t()
    assert storage_key(a) == storage_key(view), "views of one storage must share a key"
    assert storage_key(a) != storage_key(b), "distinct storages must have distinct keys"
    key = storage_key(a)
    a.untyped_storage().resize_(0)
    c = torch.empty(0)
    c.untyped_storage().resize_(0)
    # both now have data pointer 0 (why data_ptr() is not enough), the keys still differ
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() == 0
    assert storage_key(a) == key != storage_key(c), "a resized storage must keep its key"
    a.untyped_storage().resize_(4 * 3 * 4)
    assert storage_key(a) == key


def test_foreach_norm_and_mul_match_per_tensor_ops():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.randn(1, generator=g)]
    for p in (1.0, 2.0, 3.0, float("inf")):
        got = foreach_norm(ts, p)
        want = [torch.linalg.vector_norm(t, p) for t in ts]
        assert all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(got, want)), (p, got, want)
    before = [t.clone() for t in ts]
    foreach_mul_(ts, torch.tensor(0.5))
    assert all(torch.equal(t, b * 0.5) for t, b in zip(ts, before)), "foreach_mul_ must scale in place"


def test_dispatch_mode_sees_ops_and_pytree_round_trips():
    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat, _ = tree_flatten((args, kwargs or {}))
            seen.extend(storage_key(t) for t in flat if isinstance(t, torch.Tensor))
            return func(*args, **(kwargs or {}))

    w = torch.empty(3)
    with torch.no_grad(), Mode():
        w.normal_()
        torch.nn.init.zeros_(w)
    assert storage_key(w) in seen and torch.equal(w, torch.zeros(3)), seen

    tree = ((torch.ones(2), 3), {"k": [torch.zeros(1)]})
    leaves, spec = tree_flatten(tree)
    assert [type(x) for x in leaves] == [torch.Tensor, int, torch.Tensor], leaves
    back = tree_unflatten([x * 2 if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    assert torch.equal(back[0][0], torch.full((2,), 2.0)) and back[0][1] == 3 and back[1]["k"][0].shape == (1,)
    doubled = tree_map(lambda x: x + 1 if isinstance(x, torch.Tensor) else x, tree)
    assert torch.equal(doubled[1]["k"][0], torch.ones(1)) and doubled[0][1] == 3


def test_storage_shared_sees_views_and_their_release():
    a = torch.zeros(8)
    assert not storage_shared(a), "a tensor alone must not count as shared"
    view = a[2:5]
    assert storage_shared(a) and storage_shared(view), "a live view shares the storage"
    del view
    assert not storage_shared(a), "a dropped view must no longer count"
    grad = a.view(2, 4)[0]
    kept = [grad]
    del grad
    assert storage_shared(a), "a view kept in a list still shares it"
    kept.clear()
    assert not storage_shared(a)
