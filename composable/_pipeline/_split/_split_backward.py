"""A stage's backward in two halves: the input gradient now (``I``), the weight gradients later (``W``).

[Note: split backward]
Zero-bubble schedules run a stage's backward as ``I`` (the input gradient the previous stage waits
for) and later ``W`` (the parameters' gradients), both on the one forward's graph, recomputing
nothing. The graph from the output ``y`` splits into ``X``, the nodes with a path to the input
``x``, and the rest; a path to a parameter leaves ``X`` once, along a *frontier edge* ``N -> M``.

* ``I`` = ``torch.autograd.grad(y, x, g, retain_graph=True)``: autograd computes only the outputs
  on paths to ``x`` (``dX = dY W``, not ``dW``). A pre-hook on every frontier source ``N`` keeps
  the gradient that reached it.
* ``W``, phase 1: each source's skipped outputs (``dW``) from the kept gradient: for a linear's or
  a gain's node by autograd's formula on what ``N`` saved ([Note: weight gradients from saved
  tensors] in ``_compat.py``), else ``autograd.grad`` from ``N`` to its frontier edges. Phase 2:
  ``autograd.backward`` from the frontier edges ([Note: weight gradients in bounded batches]), so
  ``.grad`` accumulates as ``loss.backward()``.

Phase 1 is exact if each frontier target has one frontier source and none is reachable from
another (the plan checks this); otherwise ``W`` falls back to ``autograd.backward(y, g)`` over
the retained graph. On the first stage ``I`` does nothing and ``W`` is the full backward. A
reentrant checkpoint computes its weight gradients during ``I``; the result is the same. A
stage's `SplitCache` finds ``X`` and the frontier once ([Note: recorded graph shape] in
``_graph_split.py``).

[Note: what I keeps for W]
Right after ``I`` each frontier source of a linear's or a gain's node is *bound*
(`bind_weight_grads`): its kept gradient and the operand its ``dW`` reads go into a small
function and the node is let go, so the rest of ``X`` (attention scores, norm statistics...) is
freed when ``I`` ends, not when ``W`` does. A source that cannot be bound (another node type, an
operand behind an unpack hook such as a non-reentrant checkpoint's) holds its node until ``W``.

[Note: weight gradients in bounded batches]
``W`` hands the sources' ``dW`` to the engine once `PHASE2_BYTES` of them wait, so it holds about
one layer's weight gradients at a time (example Llama, dim 512, ``zbv``, p=2: 3 600 page faults a
step instead of 25 000; torch 2 400). A batch ends only where no parameter gets gradients from
both sides, so each ``AccumulateGrad`` runs once per ``W`` with the sum of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ._compat import bind_weight_grads, run_backward, weight_grads_of
from ._graph_split import Source, SplitCache, graph_split

__all__ = ["PHASE2_BYTES", "PendingWeights", "input_grad", "weight_grad"]

PHASE2_BYTES = 1 << 20
"""``W`` hands its weight gradients to the engine once this many bytes of them are computed (at a
point where no parameter gets gradients from both sides): [Note: weight gradients in bounded batches]."""


@dataclass
class PendingWeights:
    """What ``I`` keeps for its ``W``: the roots (outputs and their gradients, for the fallback),
    each frontier source (`Source`) with the gradient that reached it."""

    outputs: list
    grads: list
    sources: list = field(default_factory=list)  # (Source, grad_outputs or None)
    bound: list = field(default_factory=list)  # (bind_weight_grads's function, frontier edges, grad_outputs)
    exact: bool = True
    done: bool = False  # I ran the full backward (a reentrant checkpoint in the graph)

    def kept_bytes(self) -> int:
        """Bytes of the gradients kept at the frontier sources (what ``I`` holds for ``W`` beyond
        the graph, or beyond the saved operands its bound sources read)."""
        seen: set[int] = set()
        total = 0
        for *_, grads in self.sources + self.bound:
            for g in grads or ():
                if isinstance(g, torch.Tensor) and id(g) not in seen:
                    seen.add(id(g))
                    total += g.numel() * g.element_size()
        return total


def input_grad(outputs: list[torch.Tensor], grads: list, x: torch.Tensor | None, cache: SplitCache | None = None
               ) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: the gradient of ``x`` (None on a first stage, ``x is None``) and what ``W`` needs.
    ``grads[k]`` is the gradient of ``outputs[k]`` (None for a scalar loss). ``cache``: the stage's
    `SplitCache`, which finds the split of a graph shaped as the last one without walking it
    ([Note: recorded graph shape] in ``_graph_split.py``)."""
    pending = PendingWeights(outputs, grads)
    if x is None:
        return None, pending
    target = get_gradient_edge(x).node
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    found: dict[Node, Source] = {}
    exact, reentrant = True, False
    for root in roots:
        srcs, ok, re = cache.split(root, target) if cache is not None and len(roots) == 1 else graph_split(root, target)
        exact, reentrant = exact and ok, reentrant or re
        for src in srcs:
            found.setdefault(src.node, src)
    if reentrant:  # it refuses autograd.grad: the whole backward now, W has nothing left
        pending.done = True
        x.grad = None
        torch.autograd.backward(outputs, grads)
        return x.grad, pending
    pending.exact = exact and len(roots) == 1
    kept: dict[Node, tuple] = {}
    keep = kept.__setitem__  # a pre-hook ``keep(node, grad_outputs)``: no Python frame per call
    # a node pre-hook, not a capture (``inputs=[GradientEdge(node, 0)]``): it sees the gradient
    # after the node's tensor hooks (fully_shard's, a user's), as the node itself does
    handles = [node.register_prehook(partial(keep, node)) for node in found] if pending.exact else []
    try:
        (gx,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if pending.exact:
        _bind(pending, [(src, kept.get(node)) for node, src in found.items()])
    return gx, pending


def _bind(pending: PendingWeights, sources: list) -> None:
    """Keep for ``W`` only what it reads ([Note: what I keeps for W])."""
    for src, grads in sources:
        if grads is None or all(g is None for g in grads):
            continue  # the node never ran in I: no gradient reached it
        fn = bind_weight_grads(src.node, grads, src.slots, src.edges, unhooked=True)
        if fn is None:
            pending.sources.append((src, grads))
        else:
            pending.bound.append((fn, src.edges, grads))
    pending.outputs, pending.grads = [], []  # W of an exact split never starts from the outputs


def weight_grad(pending: PendingWeights, x: torch.Tensor | None) -> None:
    """``W``: accumulate the parameters' gradients into ``.grad`` from what ``I`` kept."""
    if pending.done:
        return
    if x is None or not pending.exact:
        inputs = None
        if x is not None:  # everything but the stage input, which I already served
            inputs = _leaves_except(pending.outputs, get_gradient_edge(x).node)
            if not inputs:
                return
        torch.autograd.backward(pending.outputs, pending.grads, inputs=inputs)
        return
    work: list = [(fn, e) for fn, e, _ in pending.bound]
    work += [(partial(_through_engine, s, g), s.edges) for s, g in pending.sources]
    pending.sources, pending.bound = [], []  # the kept gradients are spent
    leaves = [_leaves_below(e) for _, e in work]
    last = {leaf: i for i, found in enumerate(leaves) for leaf in found}
    edges: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    held, reach = 0, -1
    for i in range(len(work)):
        fn, src_edges = work[i]
        work[i] = None  # its gradient and operands go once used
        with torch.no_grad():
            got = fn()
        del fn
        for e, g in zip(src_edges, got):
            if g is not None:
                edges.append(e)
                values.append(g)
                held += g.numel() * g.element_size()
        reach = max([reach, *(last[leaf] for leaf in leaves[i])])
        if held >= PHASE2_BYTES and reach <= i:  # [Note: weight gradients in bounded batches]
            run_backward(edges, values)
            edges, values, held = [], [], 0
    if edges:
        run_backward(edges, values)


def _through_engine(src: Source, grad_outputs: tuple) -> list:
    """A source `bind_weight_grads` left alone: `weight_grads_of` now, or the engine runs the node
    once more for its frontier outputs."""
    got = weight_grads_of(src.node, grad_outputs, src.slots, src.edges)  # [Note: weight gradients from saved tensors]
    if got is not None:
        return got
    roots = [GradientEdge(src.node, k) for k, g in enumerate(grad_outputs) if g is not None]
    return list(torch.autograd.grad(roots, src.edges, [g for g in grad_outputs if g is not None],
                                    retain_graph=True, allow_unused=True))


def _childless(starts: list[Node]) -> list[Node]:
    """The nodes without children under ``starts`` (``AccumulateGrad``: the leaves), each once."""
    seen: set[Node] = set()
    out: list[Node] = []
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        children = [c for c, _ in n.next_functions if c is not None]
        if not children:
            out.append(n)
        stack.extend(children)
    return out


def _leaves_below(edges: list[GradientEdge]) -> set[Node]:
    """The parameters' nodes that ``edges`` lead to (where a batch of `weight_grad` may end)."""
    return set(_childless([e.node for e in edges]))


def _leaves_except(outputs: list[torch.Tensor], skip: Node) -> list[torch.Tensor]:
    """The leaves (of ``AccumulateGrad`` nodes) under ``outputs`` but ``skip`` (the fallback's inputs)."""
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    return [n.variable for n in _childless(roots) if n is not skip and hasattr(n, "variable")]
