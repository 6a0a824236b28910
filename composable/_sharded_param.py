"""One parameter under ``fully_shard``: its sharded DTensor form and its unsharded form.

A ``ShardedParam`` owns two ``nn.Parameter`` objects for one original parameter:

* ``sharded`` — an ``nn.Parameter`` wrapping a ``DTensor`` with placements ``(Shard(0),)`` on
  a 1-D mesh or ``(Replicate(), Shard(0))`` on a 2-D mesh, in the original dtype (the fp32
  "master" copy under mixed precision). Its local tensor is a view into the unit's flat
  sharded buffer (``ParamGroup.sharded_bytes``), so the all-gather reads the optimizer's
  updates with no copy. This is what ``module.parameters()``, ``state_dict()`` and the
  optimizer see between steps. Its ``.grad`` is a DTensor of the same layout and dtype.
* ``unsharded`` — a plain ``nn.Parameter`` of the full shape in the compute dtype
  (``MixedPrecisionPolicy.param_dtype``, else the original), owning its storage. It is
  registered on the module only while the unit is unsharded (forward/backward) and its
  storage is freed by resizing it to zero bytes when resharded.

[Note: freeing by storage resize]
Autograd saves the unsharded parameter for backward (``F.linear`` saves its weight). We must
free the memory after forward without invalidating that saved tensor, so we never replace the
tensor object: ``untyped_storage().resize_(0)`` drops the bytes and the all-gather before
backward resizes the same storage back and fills it. Writes go through ``.data`` (an alias
with its own version counter), so autograd's in-place checks do not fire on the refill.

Parameters that appear under several names inside one unit (shared within the unit, e.g. an
embedding tied to the output head) are one ``ShardedParam`` with several ``uses``; all of
them are swapped together, so the tie holds in forward and both uses' gradients add up.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._layout import DimZeroLayout, scatter_rows

__all__ = ["ShardedParam"]


class ShardedParam:
    """One original parameter: ``fqn`` (its first name under the unit's module), ``uses``
    (every ``(module, attribute)`` that holds it) and its dim-0 ``layout`` over the shard axis.

    ``padded`` is this rank's ``[layout.padded_numel]`` segment of the flat sharded buffer, in
    the original dtype; ``compute_dtype``/``compute_device`` describe the unsharded tensor.
    """

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        uses: list[tuple[nn.Module, str]],
        layout: DimZeroLayout,
        padded: torch.Tensor,
        mesh,
        shard_rank: int,
        compute_dtype: torch.dtype,
        compute_device: torch.device,
    ) -> None:
        self.fqn = fqn
        self.uses = uses
        self.layout = layout
        self.mesh = mesh
        self.shard_rank = shard_rank
        self.orig_dtype = param.dtype
        self.compute_dtype = compute_dtype
        self.requires_grad = param.requires_grad
        self.placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        self.global_stride = torch.empty(layout.shape, device="meta").stride()
        self.unsharded = nn.Parameter(
            torch.empty(layout.shape, dtype=compute_dtype, device=compute_device),
            requires_grad=param.requires_grad,
        )
        self.free_unsharded()
        self.set_storage(padded, None if param.device.type == "meta" else param.detach())

    # -- layouts ---------------------------------------------------------------------------
    def set_storage(self, padded: torch.Tensor, full: torch.Tensor | None) -> None:
        """Point the sharded parameter at ``padded`` (and fill it with this rank's rows of
        ``full`` when given). Used at construction and when materialising from meta."""
        self.padded = padded
        if full is not None:
            with torch.no_grad():
                scatter_rows(self.layout, full, padded.view(1, -1), self.shard_rank, self.shard_rank + 1)
        n = self.layout.shard_rows(self.shard_rank) * self.layout.row_numel
        local = padded[:n].view(self.layout.shard_shape(self.shard_rank))
        self.sharded = nn.Parameter(self._as_dtensor(local), requires_grad=self.requires_grad)

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(self.layout.shape),
            stride=self.global_stride,
        )

    def local_shard(self) -> torch.Tensor:
        """This rank's unpadded shard (a view of the flat sharded buffer)."""
        return self.sharded.to_local()

    # -- unsharded storage (see [Note: freeing by storage resize]) ------------------------------
    @property
    def unsharded_allocated(self) -> bool:
        return self.unsharded.untyped_storage().size() > 0

    def alloc_unsharded(self) -> torch.Tensor:
        """Give the unsharded parameter its bytes back; returns a writable alias."""
        t = self.unsharded.data
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)
        return t

    def free_unsharded(self) -> None:
        self.unsharded.data.untyped_storage().resize_(0)

    # -- which tensor the module sees ------------------------------------------------------------
    def register(self, unsharded: bool) -> None:
        p = self.unsharded if unsharded else self.sharded
        for module, name in self.uses:
            module._parameters[name] = p

    # -- gradients -------------------------------------------------------------------------
    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Set (or add to) ``sharded.grad`` from this rank's reduced shard ``local_grad``
        (cast to the original dtype and moved to the shard's device if needed)."""
        device = self.padded.device
        if self.sharded.grad is None:
            self.sharded.grad = self._as_dtensor(local_grad.to(device=device, dtype=self.orig_dtype))
        else:
            with torch.no_grad():
                self.sharded.grad.to_local().add_(local_grad.to(device))
