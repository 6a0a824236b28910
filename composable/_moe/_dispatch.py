"""Token dispatch and combine over the ``ep`` group: differentiable ``all_to_all_single``.

[Note: dispatch and combine]
Rows arrive sorted by global expert, ``counts[e]`` for expert ``e`` on ep rank ``e // L`` (``L =
E / ep``). One ``all_to_all_single`` of the counts gives ``recv[s, j]`` (rows source ``s`` has for
local expert ``j``); the rows go with input splits ``counts.view(ep, L).sum(1)`` and output splits
``recv.sum(1)``; a permutation regroups them by local expert for the experts and back; the
reverse all-to-all (splits swapped) returns every row in the order sent. `all_to_all`'s backward
is the reverse all-to-all of the gradient.
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
