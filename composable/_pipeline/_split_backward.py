"""A stage's backward in two halves: the input gradient now (``I``), the weight gradients later (``W``).

[Note: split backward]
Zero-bubble schedules run a stage's backward as ``I`` — only the gradient of the stage's input,
which the previous stage waits for — and, later, ``W`` — the gradients of its parameters, which
nothing waits for. Both run on the autograd graph of the one forward; nothing is recomputed
(beyond what activation checkpointing recomputes anyway).

The graph from the stage's output ``y`` splits into ``X``, the nodes with a path to the stage
input ``x``, and the rest, which only lead to parameters (and other leaves). A path from ``y``
to a parameter runs through ``X`` and leaves it once, along a *frontier edge* ``N -> M`` (``N``
in ``X``, ``M`` not; nothing outside ``X`` leads back into it). So:

* ``I`` = ``torch.autograd.grad(y, x, g, retain_graph=True)``. autograd runs only the nodes on
  paths to ``x`` and, inside each, computes only the outputs on them (a linear layer's
  ``dX = dY W``, not its ``dW = dY^T X``). A pre-hook on every frontier source ``N`` keeps the
  gradient that reached ``N`` (its ``grad_outputs``).
* ``W``, phase 1: for each frontier source ``N``, ``autograd.grad`` from ``N`` (a
  ``GradientEdge`` with the kept gradient) to its own frontier edges: this runs ``N`` once more
  for the outputs ``I`` skipped (``dW``). Phase 2: one ``autograd.backward`` from all frontier
  edges with those gradients, outside ``X``: the parameters' ``AccumulateGrad`` nodes (and
  their hooks) run as in a full backward, so ``.grad`` accumulates as ``loss.backward()``.

Phase 1 runs ``N`` alone only if no other path from ``N`` reaches its frontier edges; the plan
checks the sufficient condition "each frontier target has one frontier source and none is
reachable from another" (true of ordinary layers, tied weights used through separate ops
included). Where it fails (one parameter's ``AccumulateGrad`` fed directly by two nodes of
``X``, say a norm module run twice), ``W`` falls back to ``autograd.backward(y, g)`` over the
retained graph: exact, at the cost of walking ``X`` again. On the first stage there is no
``x``: ``I`` does nothing and ``W`` is the full backward. A reentrant activation checkpoint
(``use_reentrant=True``) computes its weight gradients inside its own backward, during ``I``;
the result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PendingWeights", "input_grad", "weight_grad"]


@dataclass
class PendingWeights:
    """What ``I`` keeps for its ``W``: the roots (outputs and their gradients, for the fallback),
    each frontier source with its frontier edges and the gradient that reached it."""

    outputs: list
    grads: list
    sources: list = field(default_factory=list)  # (node, [GradientEdge], grad_outputs or None)
    exact: bool = True
    done: bool = False  # I ran the full backward (a reentrant checkpoint in the graph)


def _graph_split(root: Node, target: Node) -> tuple[list[tuple[Node, list[GradientEdge]]], bool, bool]:
    """The frontier sources under ``root`` with their frontier edges, whether phase 1 may run
    each source alone ([Note: split backward]), and whether a reentrant checkpoint is in ``X``."""
    reaches: dict[Node, bool] = {target: True}
    kids: dict[Node, tuple] = {}
    stack: list[Node] = [root]
    while stack:  # iterative post-order: does each node reach ``target``?
        node = stack[-1]
        if node in reaches:
            stack.pop()
            continue
        nexts = kids.get(node)
        if nexts is None:  # first visit: its children go first
            nexts = kids[node] = node.next_functions
            todo = [c for c, _ in nexts if c is not None and c not in reaches]
            if todo:
                stack.extend(todo)
                continue
        stack.pop()
        reaches[node] = any(reaches.get(c, False) for c, _ in nexts if c is not None)
    sources: list[tuple[Node, list[GradientEdge]]] = []
    feeders: dict[tuple[Node, int], int] = {}
    for node, inside in reaches.items():
        if not inside or node is target:
            continue
        edges: list[GradientEdge] = []
        for child, nr in kids[node]:
            if child is not None and not reaches.get(child, False):
                key = (child, nr)
                if all((e.node, e.output_nr) != key for e in edges):
                    edges.append(GradientEdge(child, nr))
                    feeders[key] = feeders.get(key, 0) + 1
        if edges:
            sources.append((node, edges))
    exact = all(n == 1 for n in feeders.values()) and not _targets_reach_each_other({k[0] for k in feeders})
    reentrant = any(type(n).__name__ == _REENTRANT for n, inside in reaches.items() if inside)
    return sources, exact, reentrant


_REENTRANT = "CheckpointFunctionBackward"  # torch.utils.checkpoint(use_reentrant=True)'s node


def _targets_reach_each_other(targets: set[Node]) -> bool:
    for start in targets:
        seen: set[Node] = set()
        stack = [n for n, _ in start.next_functions if n is not None]
        while stack:
            n = stack.pop()
            if n in targets:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(c for c, _ in n.next_functions if c is not None)
    return False


def input_grad(outputs: list[torch.Tensor], grads: list, x: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: the gradient of ``x`` (None on a first stage, ``x is None``) and what ``W`` needs.
    ``grads[k]`` is the gradient of ``outputs[k]`` (None for a scalar loss)."""
    pending = PendingWeights(outputs, grads)
    if x is None:
        return None, pending
    target = get_gradient_edge(x).node
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    found: dict[Node, list[GradientEdge]] = {}
    exact, reentrant = True, False
    for root in roots:
        srcs, ok, re = _graph_split(root, target)
        exact, reentrant = exact and ok, reentrant or re
        for node, edges in srcs:
            found.setdefault(node, edges)
    if reentrant:  # it refuses autograd.grad: the whole backward now, W has nothing left
        pending.done = True
        x.grad = None
        torch.autograd.backward(outputs, grads)
        return x.grad, pending
    pending.exact = exact and len(roots) == 1
    kept: dict[Node, tuple] = {}

    def keeper(node: Node):
        def hook(grad_outputs):
            kept[node] = tuple(grad_outputs)
        return hook

    handles = [node.register_prehook(keeper(node)) for node in found] if pending.exact else []
    try:
        (gx,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    pending.sources = [(node, edges, kept.get(node)) for node, edges in found.items()]
    return gx, pending


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
    edges: list[GradientEdge] = []
    values: list[torch.Tensor] = []
    for node, out_edges, grad_outputs in pending.sources:
        if grad_outputs is None:
            continue  # the node never ran in I: no gradient reached it
        roots = [GradientEdge(node, k) for k, g in enumerate(grad_outputs) if g is not None]
        if not roots:
            continue
        got = torch.autograd.grad(roots, out_edges, [g for g in grad_outputs if g is not None],
                                  retain_graph=True, allow_unused=True)
        for e, g in zip(out_edges, got):
            if g is not None:
                edges.append(e)
                values.append(g)
    if edges:
        torch.autograd.backward(edges, values)


def _leaves_except(outputs: list[torch.Tensor], skip: Node) -> list[torch.Tensor]:
    """The leaves (of ``AccumulateGrad`` nodes) under ``outputs`` but ``skip`` (the fallback's inputs)."""
    seen: set[Node] = set()
    leaves: list[torch.Tensor] = []
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        children = [c for c, _ in n.next_functions if c is not None]
        if not children and n is not skip and hasattr(n, "variable"):
            leaves.append(n.variable)
        stack.extend(children)
    return leaves
