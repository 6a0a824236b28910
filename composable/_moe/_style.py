"""`ExpertParallel`: the plan entry that splits a `GroupedExperts` over the ``ep`` mesh.

``parallelize_module(model, expert_meshes(mesh).ep, {"layers.*.moe": ExpertParallel()})``: each
ep rank keeps ``E / ep`` whole experts (``Shard(0)`` DTensors) and the experts' forward dispatches
rows to their experts' ranks and combines them back ([Note: dispatch and combine] in
`_dispatch.py`); the `MoE` is unchanged ([Note: the order of the routed rows] in `_layer.py`).
Per forward one all-to-all of counts and two of rows. Dense parameters are untouched: reduce their
gradients over the data-parallel ranks as usual.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .._tp import ApplyContext, ParallelStyle
from ._dispatch import all_to_all, exchange_counts, regroup_index
from ._experts import GroupedExperts, expert_ffn, local_weight
from ._layer import MoE

__all__ = ["ExpertParallel", "DispatchStats"]


@dataclass(frozen=True)
class DispatchStats:
    """One expert-parallel forward on this rank (``experts.dispatch_stats``): rows ``sent`` to and
    ``received`` from each ep rank (``[ep]``), and rows computed ``per_local_expert``."""

    sent: tuple[int, ...]
    received: tuple[int, ...]
    per_local_expert: tuple[int, ...]


class ExpertParallel(ParallelStyle):
    """Split the experts of a `GroupedExperts` (or a `MoE`'s) over a 1-D ep mesh; ``num_experts``
    must be a multiple of its size (``ValueError`` before anything changes). ``src_data_rank``
    applies as in `parallelize_module`."""

    def _target(self, module: nn.Module, ctx: ApplyContext) -> GroupedExperts:
        target = module.experts if isinstance(module, MoE) else module
        if not isinstance(target, GroupedExperts):
            raise TypeError(f"{ctx.where(self, module)}: ExpertParallel applies to a GroupedExperts or a MoE "
                            "(shardwise.composable.MoE); swap a model's own MoE block for MoE first "
                            "(docs/expert_parallel.md)")
        return target

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        target = self._target(module, ctx)
        done = [n for n, p in target.named_parameters() if isinstance(p, DTensor)]
        if done:
            raise ValueError(f"{ctx.where(self, module)}: parameters {done} are already DTensors "
                             "(ExpertParallel applied twice?)")
        if "forward" in vars(target):
            raise ValueError(f"{ctx.where(self, module)}: the experts already have their own forward attribute")

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        target = self._target(module, ctx)
        check_experts_divide(target.num_experts, mesh.size(), ctx.where(self, module))
        for name, param in list(target.named_parameters(recurse=False)):
            dt = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=ctx.src_data_rank)
            target.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        target.forward = functools.partial(_ep_forward, target, mesh)  # type: ignore[method-assign]


def check_experts_divide(num_experts: int, ep: int, where: str) -> None:
    """Each ep rank holds ``num_experts / ep`` whole experts: refuse an ep that does not divide them."""
    if num_experts % ep:
        raise ValueError(f"{where}: num_experts({num_experts}) is not a multiple of the ep mesh size({ep}); "
                         f"{num_experts} % {ep} = {num_experts % ep}: use an ep that divides the number of experts")


FFN = Callable[[torch.Tensor, list, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _ep_forward(experts: GroupedExperts, mesh: DeviceMesh, x: torch.Tensor, counts: torch.Tensor,
                ffn: FFN = expert_ffn) -> torch.Tensor:
    """The experts' forward under `ExpertParallel` ([Note: dispatch and combine]); ``ffn``
    computes the rows grouped by local expert (`expert_ffn`, or its tensor-parallel form)."""
    group, ep = mesh.get_group(), mesh.size()
    recv = exchange_counts(counts, ep, group).tolist()
    sent = counts.view(ep, -1).sum(dim=1).tolist()
    received = [sum(row) for row in recv]
    rows = all_to_all(x, received, sent, group)
    per_local = [sum(row[j] for row in recv) for j in range(len(recv[0]))]
    index = torch.tensor(regroup_index(recv), dtype=torch.int64, device=x.device)
    out = ffn(rows.index_select(0, index), per_local, local_weight(experts.w1), local_weight(experts.w2),
              local_weight(experts.w3))
    back = out.new_empty(out.shape).index_copy(0, index, out)  # (local expert, source) -> (source, local expert)
    experts.dispatch_stats = DispatchStats(tuple(sent), tuple(received), tuple(per_local))
    return all_to_all(back, sent, received, group)
