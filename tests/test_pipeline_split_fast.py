"""The split backward's fast paths, bit for bit against one full backward.

* ``W`` computes the weight gradients of linear layers (``mm`` with the weight row- or column-major,
  ``addmm`` with a bias) and of gains (``mul``, broadcast) from what their nodes saved
  ([Note: weight gradients from saved tensors] in composable/_pipeline/_split/_compat.py), and falls back
  to the engine for other nodes (a LayerNorm) and cases (``addmm`` with ``alpha != 1``).
* ``SplitCache`` replays the split of a graph of the same shape and walks again when the shape
  differs ([Note: recorded graph shape] in composable/_pipeline/_split/_graph_split.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.composable._pipeline._split import _split_backward
from shardwise.composable._pipeline._split._compat import bind_weight_grads, weight_grads_of
from shardwise.composable._pipeline._split._graph_split import SplitCache, graph_split, number
from shardwise.composable._pipeline._split._split_backward import input_grad, weight_grad
from tests._dist import run_ranks


class Net(nn.Module):
    """Every known node type, an unknown one (LayerNorm) and a branch that changes the graph."""

    def __init__(self, d: int, h: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(d, h, bias=bias)           # 3-D input: mm (no bias) or addmm
        self.down = nn.Parameter(torch.randn(h, d))    # h @ down: mat2 row-major
        self.side = nn.Parameter(torch.randn(d, d))    # h @ side.t(): mat2 column-major
        self.gain = nn.Parameter(torch.randn(d))       # mul, broadcast over batch and time
        self.flat = nn.Linear(d, d)                    # 2-D input: addmm directly
        self.norm = nn.LayerNorm(d)                    # unknown to the fast path: the engine

    def forward(self, x, branch: bool = False):
        h = torch.tanh(self.up(x)) @ self.down
        h = h + (x @ self.side.t()) * self.gain
        if branch:  # another graph: one more node on the path
            h = h * 2
        h = self.norm(h)
        return self.flat(h.flatten(0, 1)).view_as(h)


def _reference(net, xs, gs):
    net.zero_grad(set_to_none=True)
    dx = []
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_()
        torch.autograd.backward(net(x), g)
        dx.append(x.grad)
    return {n: p.grad.clone() for n, p in net.named_parameters()}, dx


def _split(net, xs, gs, cache, branches=None):
    net.zero_grad(set_to_none=True)
    kept, dx = [], []
    for i, (x, g) in enumerate(zip(xs, gs)):
        x = x.clone().requires_grad_()
        gx, pending = input_grad([net(x, bool(branches and branches[i]))], [g], x, cache)
        assert all(p.grad is None for p in net.parameters()), "I computed parameter gradients"
        kept.append((x, pending))
        dx.append(gx)
    for x, pending in kept:
        weight_grad(pending, x)
    return {n: p.grad.clone() for n, p in net.named_parameters()}, dx


def _count_direct(monkeypatch):
    """Count how the sources' weight gradients are found: bound in ``I`` / computed directly in
    ``W`` (``direct``), or left to the engine."""
    seen = {"direct": 0, "engine": 0}

    def bind_spy(*args, **kw):
        got = bind_weight_grads(*args, **kw)
        if got is not None:
            seen["direct"] += 1
        return got

    def spy(*args):
        got = weight_grads_of(*args)
        seen["engine" if got is None else "direct"] += 1
        return got
    monkeypatch.setattr(_split_backward, "bind_weight_grads", bind_spy)
    monkeypatch.setattr(_split_backward, "weight_grads_of", spy)
    return seen


@settings(deadline=None, max_examples=30)
@given(b=st.integers(1, 3), t=st.integers(1, 6), d=st.integers(1, 7), h=st.integers(1, 9), bias=st.booleans(),
       micro=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_fast_weight_gradients_are_bit_exact(b, t, d, h, bias, micro, dtype):
    torch.manual_seed(b * 1000 + t * 100 + d * 10 + h)
    net = Net(d, h, bias).to(dtype)
    xs = [torch.randn(b, t, d, dtype=dtype) for _ in range(micro)]
    gs = [torch.randn(b, t, d, dtype=dtype) for _ in range(micro)]
    ref, ref_dx = _reference(net, xs, gs)
    got, dx = _split(net, xs, gs, SplitCache())
    assert set(got) == set(ref)
    for n in ref:
        assert torch.equal(got[n], ref[n]), (n, (got[n] - ref[n]).abs().max())
    assert all(torch.equal(a, r) for a, r in zip(dx, ref_dx))


def test_known_nodes_skip_the_engine_and_others_use_it(monkeypatch):
    seen = _count_direct(monkeypatch)
    net = Net(4, 5, bias=True)
    xs, gs = [torch.randn(2, 3, 4)], [torch.randn(2, 3, 4)]
    ref, _ = _reference(net, xs, gs)
    got, _ = _split(net, xs, gs, SplitCache())
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    # up (addmm), down and side (mm), gain (mul), flat (addmm): direct; the LayerNorm: the engine
    assert seen == {"direct": 5, "engine": 1}, seen


def test_unknown_cases_are_left_to_the_engine():
    x = torch.randn(3, 4, requires_grad=True)
    w, b = torch.randn(4, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    y = torch.addmm(b, x, w, alpha=2.0)
    g = (torch.randn(3, 5),)
    srcs, _, _ = graph_split(y.grad_fn, torch.autograd.graph.get_gradient_edge(x).node)
    (src,) = srcs
    assert weight_grads_of(src.node, g, src.slots, src.edges) is None  # alpha != 1: not addmm's plain form
    assert weight_grads_of(src.node, (None,), src.slots, src.edges) is None  # no gradient: nothing to compute
    z = torch.randn(3, 4, dtype=torch.complex64, requires_grad=True)
    gain = torch.randn(4, dtype=torch.complex64, requires_grad=True)
    zs, _, _ = graph_split((z * gain).grad_fn, torch.autograd.graph.get_gradient_edge(z).node)
    assert weight_grads_of(zs[0].node, (torch.randn(3, 4, dtype=torch.complex64),), zs[0].slots, zs[0].edges) is None


def test_the_split_is_replayed_for_a_graph_of_the_same_shape():
    net = Net(4, 6, bias=False)
    cache = SplitCache()
    xs, gs = [torch.randn(2, 3, 4) for _ in range(4)], [torch.randn(2, 3, 4) for _ in range(4)]
    ref, _ = _reference(net, xs, gs)
    got, _ = _split(net, xs, gs, cache)
    assert (cache.hits, cache.misses) == (3, 1)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_a_graph_of_another_shape_is_walked_again():
    """Data-dependent control flow: the cache must not reuse the split of the other graph."""
    net = Net(4, 6, bias=True)
    cache = SplitCache()
    branches = [False, True, True, False]
    xs, gs = [torch.randn(2, 3, 4) for _ in range(4)], [torch.randn(2, 3, 4) for _ in range(4)]
    net.zero_grad(set_to_none=True)
    for x, g, br in zip(xs, gs, branches):
        x = x.clone().requires_grad_()
        torch.autograd.backward(net(x, br), g)
    ref = {n: p.grad.clone() for n, p in net.named_parameters()}
    got, _ = _split(net, xs, gs, cache, branches)
    assert (cache.hits, cache.misses) == (1, 3), (cache.hits, cache.misses)  # F T(miss) T(hit) F(miss)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_shape_tells_apart_graphs_that_differ_only_in_sharing():
    """Same node classes in the same order; one reuses a node where the other has two."""
    p = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    a = x * p
    shared = (a + a).grad_fn
    two = (x * p + x * p).grad_fn
    _, _, s1 = number(shared)
    _, _, s2 = number(two)
    assert s1 != s2 and s1.classes[:2] == s2.classes[:2]


def test_kept_bytes_counts_each_kept_gradient_once():
    net = Net(4, 6, bias=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    _, pending = input_grad([net(x)], [torch.randn(2, 3, 4)], x)
    grads = {id(g): g for *_, gs in pending.sources + pending.bound for g in gs or () if g is not None}
    assert pending.kept_bytes() == sum(g.numel() * g.element_size() for g in grads.values()) > 0
    weight_grad(pending, x)
    assert pending.kept_bytes() == 0  # spent by W


@pytest.mark.parametrize("reuse", [False, True])
def test_engine_fallback_keeps_exactness_for_a_shared_frontier(reuse):
    """A gain used twice (two feeders of one AccumulateGrad): not exact, the whole-graph fallback."""
    gain = nn.Parameter(torch.randn(4))
    x = torch.randn(2, 4, requires_grad=True)
    g = torch.randn(2, 4)
    y = (x * gain) * gain if reuse else torch.tanh(x * gain)
    torch.autograd.backward(y, g, retain_graph=True)
    ref = gain.grad.clone()
    gain.grad = None
    _, pending = input_grad([y], [g], x)
    assert pending.exact is not reuse
    weight_grad(pending, x)
    assert torch.equal(gain.grad, ref)


def test_the_graph_is_freed_after_I_but_what_W_reads():
    """[Note: what I keeps for W]: after ``I`` only the bound sources' gradients and saved operands
    stay: a tensor only the input path needs (exp's saved result) is gone; ``W`` is still exact."""
    import weakref

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, 4))
    x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    xr = x.clone().requires_grad_()
    torch.autograd.backward(torch.exp(xr @ w.t()) * 3.0, g)
    ref, w.grad = w.grad.clone(), None
    xi = x.clone().requires_grad_()
    e = torch.exp(xi @ w.t())
    alive = weakref.ref(e)
    y = e * 3.0
    del e
    gx, pending = input_grad([y], [g], xi)
    del y
    assert alive() is None, "the graph of I outlived it"
    assert pending.outputs == [] and len(pending.bound) == 1
    weight_grad(pending, xi)
    assert torch.equal(w.grad, ref) and torch.equal(gx, xr.grad)


def test_a_checkpointed_operand_is_read_by_W_not_I():
    """A saved operand behind an unpack hook (a non-reentrant checkpoint) is not bound in ``I``
    (reading it there would recompute the region to keep what the checkpoint frees)."""
    from torch.utils.checkpoint import checkpoint

    lin = nn.Linear(4, 5, bias=False)
    calls = {"n": 0}

    def region(t):
        calls["n"] += 1
        return lin(t)
    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(region, x, use_reentrant=False)
    g = torch.randn(3, 5)
    gx, pending = input_grad([y], [g], x)
    assert calls["n"] == 2, calls  # the forward and the engine's recompute in I, nothing more
    assert not pending.bound and len(pending.sources) == 1
    weight_grad(pending, x)
    ref = g.t() @ x.detach()
    assert torch.allclose(lin.weight.grad, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied_head", [False, True])
@pytest.mark.parametrize("budget", [1, 1 << 40])
def test_bounded_batches_keep_a_tied_weight_exact(monkeypatch, budget, tied_head):
    """[Note: weight gradients in bounded batches]: W hands gradients to the engine in batches,
    never splitting the two uses of a tied weight, so every gradient is bit for bit the full
    backward's; with a 1-byte budget and no tied weight every parameter goes alone."""
    monkeypatch.setattr(_split_backward, "PHASE2_BYTES", budget)
    calls = {"n": 0}
    real = _split_backward.run_backward

    def spy(edges, values):
        calls["n"] += 1
        return real(edges, values)
    monkeypatch.setattr(_split_backward, "run_backward", spy)
    torch.manual_seed(0)
    ps = {n: nn.Parameter(torch.randn(*shape)) for n, shape in
          (("tied", (5, 4)), ("other", (5, 5)), ("gain", (5,)), ("back", (4, 5)), ("head", (5, 4)))}
    head = ps["tied"] if tied_head else ps["head"]

    def f(x):
        h = x @ ps["tied"].t()
        h = torch.tanh(h @ ps["other"].t()) * ps["gain"]
        return (h @ ps["back"].t()) @ head.t()  # tied: the first weight again, through its own transpose

    x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    xr = x.clone().requires_grad_()
    torch.autograd.backward(f(xr), g)
    ref = {n: p.grad.clone() for n, p in ps.items() if p.grad is not None}
    for p in ps.values():
        p.grad = None
    xi = x.clone().requires_grad_()
    gx, pending = input_grad([f(xi)], [g], xi)
    assert pending.exact and len(pending.bound) == 5
    weight_grad(pending, xi)
    assert all(torch.equal(ps[n].grad, r) for n, r in ref.items()) and torch.equal(gx, xr.grad)
    if budget > 1:
        assert calls["n"] == 1, calls
    elif not tied_head:
        assert calls["n"] == 5, calls  # one batch per parameter
    else:
        assert 1 <= calls["n"] < 5, calls  # the two uses of the tied weight in one batch


def _mesh_without_groups(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from shardwise.composable._pipeline._split._compat import mesh_without_groups

    groups = dict(dist.distributed_c10d._world.pg_map)  # private, in a test: the groups that exist
    mesh = mesh_without_groups("cpu", [[0, 1], [2, 3]], ("a", "b"))  # ranks this job does not have
    t = DTensor.from_local(torch.zeros(2), mesh, [Shard(0), Shard(0)], run_check=False,
                           shape=torch.Size([8]), stride=(1,))
    return (mesh.mesh.tolist(), mesh.mesh_dim_names, tuple(t.shape), dict(dist.distributed_c10d._world.pg_map) == groups)


def test_mesh_without_groups_describes_other_ranks_and_makes_no_process_group():
    """The pipeline checkpoint's stand-in mesh for another stage's tensor: any ranks, named
    axes, usable as a DTensor's mesh, and no process group created (so no collective)."""
    for out in run_ranks(_mesh_without_groups, 2, timeout=60):
        assert out == ([[0, 1], [2, 3]], ("a", "b"), (8,), True), out
