"""`token_mean_loss`: the loss each rank backpropagates so that the gradient averaged over the
``N`` data-parallel ranks is that of the mean over every counted token of the global batch:
``L_r = N s_r / C`` (``s_r`` the rank's summed token losses, ``C`` the global count), which is the
local mean only when counts are equal. ``mean_over_mesh(L_r)`` is the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["token_mean_loss"]


def token_mean_loss(loss_sum: torch.Tensor, count: torch.Tensor | int, mesh: DeviceMesh) -> torch.Tensor:
    """``loss_sum * mesh.size() / C``, ``C`` the sum of ``count`` over ``mesh`` (the mesh
    ``fully_shard`` averages over). ``loss_sum``: this rank's summed token losses; ``count``: the
    tokens it counted. Collective (one tiny all-reduce per mesh axis, outside autograd); a global
    count of 0 gives a zero loss, no NaN."""
    total = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).detach().clone().reshape(1)
    for dim in range(mesh.ndim):
        dist.all_reduce(total, group=mesh.get_group(dim))
    c = float(total.item())
    return loss_sum * (mesh.size() / c if c > 0 else 0.0)
