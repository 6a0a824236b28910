"""Token dispatch and combine over the ``ep`` group: ``all_to_all_single`` with variable splits,
differentiable.

[Note: dispatch and combine]
A rank's rows arrive sorted by global expert with ``counts[e]`` rows for expert ``e``; expert
``e`` lives on ep rank ``e // L`` (``L = E / ep`` local experts each, `ExpertParallel`).

1. *counts*: one ``all_to_all_single`` of the ``[E]`` counts (equal splits of ``L``): rank ``r``
   receives ``recv[s, j]``, the rows source ``s`` has for its local expert ``j``;
2. *dispatch*: the rows, ``all_to_all_single`` with input splits ``counts.view(ep, L).sum(1)``
   and output splits ``recv.sum(1)``; they arrive grouped by (source, local expert);
3. a permutation regroups them by (local expert, source), the experts compute, the inverse
   permutation restores (source, local expert);
4. *combine*: the reverse ``all_to_all_single`` (splits swapped) returns every row to its
   source, in the order it was sent.

`all_to_all` is an autograd Function: its backward is the reverse all-to-all of the output
gradient (the splits swapped), so gradients flow back to the source ranks' rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._mesh_utils import all_to_all_single

__all__ = ["all_to_all", "exchange_counts", "regroup_index"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` (``sum(in_splits)`` of them, ``in_splits[r]`` consecutive rows for group rank
    ``r``) sent; the ``sum(out_splits)`` rows received returned (``out_splits[s]`` from rank
    ``s``, in rank order). Differentiable (backward: the reverse exchange)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, ep: int, group) -> torch.Tensor:
    """``recv`` ``[ep, L]``: ``recv[s, j]`` = rows source ``s`` sends to this rank's local expert
    ``j`` (step 1 of [Note: dispatch and combine])."""
    counts = counts.to(torch.int64).contiguous()
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return recv.view(ep, -1)


def regroup_index(recv: list[list[int]]) -> list[int]:
    """The permutation taking rows grouped (source, local expert), sizes ``recv[s][j]``, to
    rows grouped (local expert, source): ``regrouped = received[index]``."""
    starts: list[list[int]] = []
    offset = 0
    for row in recv:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    index: list[int] = []
    for j in range(len(recv[0]) if recv else 0):
        for s, row in enumerate(recv):
            index.extend(range(starts[s][j], starts[s][j] + row[j]))
    return index
