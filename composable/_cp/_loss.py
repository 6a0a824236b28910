"""`token_mean_loss`: the loss each rank backpropagates so that the gradient averaged over the
data-parallel ranks is the gradient of the mean over *every token* of the global batch, when
ranks hold different numbers of counted tokens (an ignore index, padding, a document mask).

``fully_shard`` averages gradients over its mesh of ``N`` ranks (``dp_shard_cp``, and
``dp_replicate``): rank ``r``'s loss ``L_r`` contributes ``grad L_r / N``. The global mean is
``sum_r s_r / C`` with ``s_r`` the rank's summed token losses and ``C`` the tokens counted over
all ranks, so each rank must backpropagate ``L_r = N s_r / C``. With equal counts ``c`` on every
rank (``C = N c``) that is the plain local mean ``s_r / c``; otherwise the local mean would weigh
a rank's tokens by ``1 / c_r`` and be wrong. The mean of ``L_r`` over the ranks is the global
mean, so logging ``mean_over_mesh(L_r)`` prints it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["token_mean_loss"]


def token_mean_loss(loss_sum: torch.Tensor, count: torch.Tensor | int, mesh: DeviceMesh) -> torch.Tensor:
    """``loss_sum * mesh.size() / C``, with ``C`` the sum of ``count`` over every rank of ``mesh``
    (the mesh ``fully_shard`` averages gradients over: `data_parallel_mesh`, 1-D or 2-D).

    ``loss_sum``: this rank's summed token losses (e.g. ``cross_entropy(..., reduction="sum")``);
    ``count``: the tokens it counted (e.g. ``(targets != ignore_index).sum()``). Collective over
    ``mesh`` (one all-reduce per mesh axis of a one-element tensor, outside autograd). A global
    count of 0 gives ``0 * loss_sum`` (a zero loss, no NaN)."""
    total = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).detach().clone().reshape(1)
    for dim in range(mesh.ndim):
        dist.all_reduce(total, group=mesh.get_group(dim))
    c = float(total.item())
    return loss_sum * (mesh.size() / c if c > 0 else 0.0)
