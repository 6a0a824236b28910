"""`ExpertTensorParallel`: experts split over ``ep`` and each expert's own weights over ``tp``.

``parallelize_module(model, em.ep, {"layers.*.feed_forward": ExpertTensorParallel(em.ep_tp)})``.
On top of `ExpertParallel`, ``w1`` / ``w3`` ``[E, hidden, dim]`` split on ``hidden`` by columns and
``w2`` ``[E, dim, hidden]`` by rows: DTensors ``(Shard(0), Shard(1))`` / ``(Shard(0), Shard(2))``
on the ``(ep, tp)`` mesh, whose ``full_tensor()`` is the unsplit stack.

[Note: expert tensor parallelism]
The `MoE` sees every token of its tp group on every tp rank (its input gathered over ``tp``), so
every tp rank routes and dispatches the same rows; each computes a partial sum of the expert's
output with its ``hidden / tp`` slice. Megatron's ``g`` after it (forward all-reduce over ``tp``,
backward identity) and ``f`` before it (forward identity, backward all-reduce of the rows' input
gradient) make it exact: everything outside the experts is identical on every tp rank with exact
gradients. Cost per layer and step: one all-reduce of the dispatched rows forward and one backward;
the expert weights, their state and ``[rows, hidden]`` activations are ``1 / tp`` per rank.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from .._mesh_utils import same_mesh
from .._tp import ApplyContext
from ._experts import GroupedExperts, expert_ffn
from ._style import ExpertParallel, _ep_forward, check_experts_divide

__all__ = ["ExpertTensorParallel"]

_PLACEMENTS = {"w1": (Shard(0), Shard(1)), "w3": (Shard(0), Shard(1)), "w2": (Shard(0), Shard(2))}


class _SumOverTP(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward ([Note: expert tensor parallelism])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward ([Note: expert tensor parallelism])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _tp_ffn(group, x: torch.Tensor, counts: list, w1: torch.Tensor, w2: torch.Tensor,
            w3: torch.Tensor) -> torch.Tensor:
    """`expert_ffn` on this tp rank's hidden slice, ``f`` before and ``g`` after."""
    return _SumOverTP.apply(expert_ffn(_CopyToTP.apply(x, group), counts, w1, w2, w3), group)


class ExpertTensorParallel(ExpertParallel):
    """`ExpertParallel` over ``ep_tp["ep"]`` plus each expert's weights over ``ep_tp["tp"]``
    (``expert_meshes(mesh).ep_tp``; `parallelize_module` gets its ``ep`` slice). ``num_experts``
    must divide by ``ep`` and ``hidden`` by ``tp`` (``ValueError`` before anything changes)."""

    def __init__(self, ep_tp: DeviceMesh) -> None:
        if not isinstance(ep_tp, DeviceMesh) or ep_tp.mesh_dim_names != ("ep", "tp"):
            names = getattr(ep_tp, "mesh_dim_names", None)
            raise ValueError(f"ExpertTensorParallel(ep_tp): pass the 2-D ('ep', 'tp') mesh, "
                             f"expert_meshes(mesh).ep_tp (of a mesh with a tp axis); got axes {names}")
        self.ep_tp = ep_tp

    def validate(self, module: nn.Module, ctx: ApplyContext) -> None:
        super().validate(module, ctx)
        target = self._target(module, ctx)
        tp = self.ep_tp.size(1)
        if target.hidden % tp:
            raise ValueError(f"{ctx.where(self, module)}: the experts' hidden({target.hidden}) is not a multiple of "
                             f"tp({tp}); {target.hidden} % {tp} = {target.hidden % tp}: use a tp that divides it")

    def apply(self, module: nn.Module, mesh: DeviceMesh, ctx: ApplyContext) -> None:
        target: GroupedExperts = self._target(module, ctx)
        if not same_mesh(mesh, self.ep_tp["ep"]):
            raise ValueError(f"{ctx.where(self, module)}: parallelize_module got a mesh that is not the 'ep' slice of "
                             "ExpertTensorParallel's (ep, tp) mesh; pass expert_meshes(mesh).ep to parallelize_module "
                             "and expert_meshes(mesh).ep_tp to ExpertTensorParallel")
        check_experts_divide(target.num_experts, mesh.size(), ctx.where(self, module))
        for name, param in list(target.named_parameters(recurse=False)):
            dt = distribute_tensor(param.detach(), self.ep_tp, list(_PLACEMENTS[name]), src_data_rank=ctx.src_data_rank)
            target.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        ffn = functools.partial(_tp_ffn, self.ep_tp.get_group(1))
        target.forward = functools.partial(_ep_forward, target, mesh, ffn=ffn)  # type: ignore[method-assign]

