"""One parameter under ``fully_shard``: its sharded DTensor form and its unsharded form.

A ``ShardedParam`` owns two ``nn.Parameter`` objects for one original parameter:

* ``sharded``: wraps a ``DTensor`` (``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))``
  on a 2-D one) in the original dtype (the fp32 master under mixed precision), its local tensor
  a view into the unit's flat buffer ([Note: flat buffers] in ``_param_group.py``). This is what
  ``parameters()``, ``state_dict()`` and the optimizer see between steps; its ``.grad`` is a
  DTensor of the same layout and dtype.
* ``unsharded``: a plain ``nn.Parameter`` of the full shape in the compute dtype, owning its
  storage, registered on the module only while the unit is unsharded and freed by storage
  resize when resharded.

[Note: freeing by storage resize]
Autograd saves the unsharded parameter for backward, so the tensor object is never replaced:
``untyped_storage().resize_(0)`` drops the bytes after forward and the all-gather before backward
resizes the same storage back and fills it. Writes go through ``.data`` (its own version
counter), so autograd's in-place checks do not fire on the refill.

[Note: ordinary tensors]
Every tensor a user reaches from a sharded model must save, pickle, deep-copy and share as
FSDP2's do. torch serializes a wrapper subclass through its (invalid) storage unless its data
pointer (the local tensor's storage offset) is 0, so a shard viewing the flat buffer at a
nonzero offset could not be saved. So each padded segment is an *ordinary* tensor: `ordinary`
gives it its own storage object over the same bytes (``torch.from_dlpack``, keeping the buffer
alive) at offset 0, and the local shard views that, as FSDP2's views its own padded tensor. The
all-gather still reads the flat buffer with no copy; reduced gradients are treated alike.

A CPU storage moved into shared memory in place (``share_memory_()``, a ``multiprocessing``
queue) gets new bytes its segment does not follow; the shard then stays the moved storage and
``ParamGroup`` copies it into the buffer before each all-gather (`ShardedParam.moved`).

A parameter already distributed by tensor parallelism keeps its TP placements on a combined
``(dp..., tp)`` mesh ([Note: sharding a tensor-parallel parameter] in ``_tp_param.py``).

[Note: a shard of one rank]
When the shard axis has one rank and no cast or device move is needed, the shard *is* the whole
parameter: the unsharded parameter is a second ``nn.Parameter`` over the same storage (``alias``),
and the unit issues no all-gather or reduce-scatter (only the replica all-reduce).

A parameter under several names in one unit (a tied embedding and head) is one ``ShardedParam``
with several ``uses``, swapped together, so the tie holds and both gradients add up.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .._compat import local_tensor, set_local_tensor
from ._extension import GatherExtension, has_extension
from ._layout import ShardLayout
from .._mesh_utils import same_mesh
from ._tp_param import tp_sharded_placements

__all__ = ["ShardedParam", "ordinary"]


def ordinary(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D, contiguous) as a tensor over its own storage object at offset 0, sharing
    ``t``'s bytes ([Note: ordinary tensors]); meta tensors as they are."""
    if t.device.type == "meta":
        return t
    return torch.from_dlpack(t.detach().view(torch.uint8)).view(t.dtype)


class ShardedParam:
    """One original parameter: ``fqn`` (its first name under the unit's module), ``uses``
    (every ``(module, attribute)`` that holds it) and its ``layout`` over the shard axis
    (``Shard(d)``, dim 0 unless ``shard_placement_fn`` chose another; [Note: the shard layout seam]).

    ``padded`` is this rank's ``[layout.padded_numel]`` segment of the flat sharded buffer, in
    the original dtype; ``compute_dtype``/``compute_device`` describe the unsharded tensor.
    """

    def __init__(
        self,
        fqn: str,
        param: torch.Tensor,
        uses: list[tuple[nn.Module, str]],
        layout: ShardLayout,
        padded: torch.Tensor,
        mesh: DeviceMesh,
        shard_rank: int,
        compute_dtype: torch.dtype,
        compute_device: torch.device,
        alias: bool = False,
    ) -> None:
        self.alias = alias  # see [Note: a shard of one rank]
        self.owner: str | None = None  # "'fqn' of the unit ...", set by fully_shard
        self.fqn = fqn
        self.uses = uses
        self.layout = layout
        self.shard_rank = shard_rank
        self.orig_dtype = param.dtype
        self.compute_dtype = compute_dtype
        self.requires_grad = param.requires_grad
        dp: tuple = (layout.placement,) if mesh.ndim == 1 else (Replicate(), layout.placement)
        self.tp_mesh: DeviceMesh | None
        self.tp_placements: tuple | None
        if isinstance(param, DTensor):  # see [Note: sharding a tensor-parallel parameter] in _tp_param.py
            self.tp_mesh, self.tp_placements = param.device_mesh, tuple(param.placements)
            self.mesh, self.placements = tp_sharded_placements(mesh, dp, layout.placement, param)
            self.global_shape = tuple(param.shape)
            data = param.to_local().detach()
        else:
            self.tp_mesh, self.tp_placements = None, None
            self.mesh, self.placements, self.global_shape = mesh, dp, layout.shape
            data = param.detach()
        self.global_stride = torch.empty(self.global_shape, device="meta").stride()
        self.compute_device = compute_device
        # [Note: the all-gather extension] in _extension.py
        self.ext = GatherExtension(fqn, layout.shape) if has_extension(data, fqn) else None
        if self.ext is not None:
            self._check_extension(layout)
            self.alias = False
        self._new_unsharded()
        if self.ext is not None:
            self.set_extension_local(self._shard_subclass(data))
        else:
            self.set_storage(padded, None if param.device.type == "meta" else data)

    # [Note: accumulating in the reduce dtype] gradients of backwards that do not reduce
    # (accumulation, pipeline microbatches) are summed here in the reduce dtype when the compute
    # dtype is lower (bf16 sums lose bits every microbatch), as FSDP2; the reduction takes the sum.
    accumulated_grad = None

    def _check_extension(self, layout: ShardLayout) -> None:
        why = None
        if layout.placement.dim != 0:
            why = f"is sharded on dim {layout.placement.dim} (the all-gather extension shards dim 0, as FSDP2's)"
        elif layout.shape[0] % layout.world:
            why = (f"has {layout.shape[0]} rows, uneven over {layout.world} ranks (FSDP2 then needs pieces of the "
                   "padded shard's size; shard it evenly)")
        if why is not None:
            raise ValueError(f"fully_shard: '{self.fqn}' is a tensor subclass with fsdp_pre_all_gather and {why}; "
                             "see 'The all-gather extension' in docs/low_precision.md")

    def _shard_subclass(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a subclass tensor, built as FSDP2 builds it: through the subclass's
        own ``chunk``, ``new_zeros`` and ``copy_`` (it owns its storage)."""
        chunk = torch.chunk(data, self.layout.world, dim=0)[self.shard_rank]
        with torch.no_grad():
            local = data.new_zeros(chunk.shape)
            if data.device.type != "meta":
                local.copy_(chunk)
        return local

    def set_extension_local(self, local: torch.Tensor) -> None:
        """Make ``local`` (a subclass with the all-gather extension, this rank's shard) the
        sharded parameter's local tensor, as a new sharded parameter."""
        self.padded = local
        self.orig_dtype = local.dtype
        self.sharded = nn.Parameter(self._as_dtensor(local), requires_grad=self.requires_grad)

    def sharded_local(self) -> torch.Tensor:
        """The local tensor object of the sharded parameter (a subclass for the all-gather
        extension): the one the user's code sets attributes on, e.g. torchao's precomputed scale."""
        sharded = self.sharded
        assert isinstance(sharded, DTensor), "a sharded parameter wraps a DTensor"
        return local_tensor(sharded)

    def _new_unsharded(self) -> None:
        if self.ext is not None:  # a stand-in until the first fsdp_post_all_gather builds it
            self.unsharded = nn.Parameter(torch.empty(0, device=self.compute_device), requires_grad=self.requires_grad)
            return
        local = torch.empty(self.layout.shape, dtype=self.compute_dtype, device=self.compute_device)
        if self.tp_mesh is not None:
            local = DTensor.from_local(local, self.tp_mesh, self.tp_placements, run_check=False,
                                       shape=torch.Size(self.global_shape), stride=self.global_stride)
        self.unsharded = nn.Parameter(local, requires_grad=self.requires_grad)
        self.free_unsharded()

    # -- layouts ---------------------------------------------------------------------------
    def set_storage(self, padded: torch.Tensor, full: torch.Tensor | None) -> None:
        """Point the sharded parameter at ``padded`` (and fill it with this rank's rows of
        ``full`` when given). Used at construction and when materialising from meta."""
        self.segment, self.padded = padded, ordinary(padded)
        if full is not None:
            with torch.no_grad():
                self.layout.scatter(full, padded.view(1, -1), self.shard_rank, self.shard_rank + 1)
        local = self.layout.local_view(self.padded, self.shard_rank)
        self.sharded = nn.Parameter(self._as_dtensor(local), requires_grad=self.requires_grad)
        if self.alias:
            self._alias_unsharded(local)

    def _alias_unsharded(self, local: torch.Tensor) -> None:  # [Note: a shard of one rank]
        full = local if self.tp_mesh is None else DTensor.from_local(
            local, self.tp_mesh, self.tp_placements, run_check=False,
            shape=torch.Size(self.global_shape), stride=self.global_stride)
        self.unsharded = nn.Parameter(full, requires_grad=self.requires_grad)

    def moved(self) -> bool:
        """Whether the shard's storage was moved off its segment of the unit's buffer (into
        shared memory; [Note: ordinary tensors])."""
        return self.ext is None and self.padded.data_ptr() != self.segment.data_ptr()

    def registered(self) -> torch.Tensor:
        """The tensor the module holds under this parameter's first name now."""
        module, name = self.uses[0]
        param = module._parameters[name]
        assert param is not None, f"'{self.fqn}' is registered on its module"
        return param

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is the sharded parameter, still a view of ``padded``."""
        if param is not self.sharded or not isinstance(param, DTensor):
            return False
        if self.ext is not None:
            return self.sharded_local() is self.padded
        local = param.to_local()
        return (local.dtype == self.padded.dtype and local.device == self.padded.device
                and local.untyped_storage().data_ptr() == self.padded.untyped_storage().data_ptr())

    def adopt(self, param: torch.Tensor, padded: torch.Tensor) -> None:
        """Take ``param`` as the sharded parameter, its values copied into ``padded`` (this
        parameter's new segment of the unit's buffer, in ``param``'s dtype). ``param`` is what
        the module holds now: the sharded parameter whose local tensor ``nn.Module._apply``
        replaced (kept as the same object: the optimizer may hold it), or what
        ``load_state_dict(assign=True)`` put there: a DTensor of this parameter's layout, or
        the full tensor. See [Note: re-adopting parameters] in ``_param_group.py``."""
        rank = self.shard_rank
        if self.ext is not None:
            self._adopt_extension(param)
            return
        segment, padded = padded, ordinary(padded)
        local = self.layout.local_view(padded, rank)
        if isinstance(param, DTensor):
            self._check_layout(param)
            src = param.to_local()
            if padded.device.type != "meta" and src.device.type != "meta":
                with torch.no_grad():
                    padded.zero_()  # the padding, then the real shard
                    local.copy_(src)
            set_local_tensor(param, local)
            self.sharded = param if isinstance(param, nn.Parameter) else nn.Parameter(param, param.requires_grad)
        else:
            if self.tp_mesh is not None or tuple(param.shape) != self.global_shape:
                raise ValueError(
                    f"fully_shard: '{self.fqn}' was replaced by a {type(param).__name__} of shape {tuple(param.shape)}; "
                    f"it takes a DTensor like the sharded parameter (distribute_tensor(full, p.device_mesh, "
                    f"p.placements)) or, without tensor parallelism, the full tensor of shape {self.global_shape}")
            if padded.device.type != "meta" and param.device.type != "meta":
                with torch.no_grad():
                    self.layout.scatter(param, padded.view(1, -1), rank, rank + 1)
            self.sharded = nn.Parameter(self._as_dtensor(local), requires_grad=param.requires_grad)
        self.segment, self.padded = segment, padded
        self.requires_grad = self.sharded.requires_grad
        self.orig_dtype = padded.dtype
        if self.alias:
            self._alias_unsharded(local)
        elif (self.unsharded_data().dtype, self.unsharded_data().device) != (self.compute_dtype, self.compute_device):
            self._new_unsharded()
        elif self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)

    def _adopt_extension(self, param: torch.Tensor) -> None:
        if isinstance(param, DTensor):
            self._check_layout(param)
            local = local_tensor(param)
            if not has_extension(local, self.fqn):
                raise ValueError(f"fully_shard: '{self.fqn}' was sharded as a tensor subclass with "
                                 f"fsdp_pre_all_gather; its new local tensor is a {type(local).__name__} without it")
            self.padded, self.orig_dtype = local, local.dtype
            self.sharded = param if isinstance(param, nn.Parameter) else nn.Parameter(param, param.requires_grad)
        else:
            if tuple(param.shape) != self.global_shape or not has_extension(param, self.fqn):
                raise ValueError(f"fully_shard: '{self.fqn}' was replaced by a {type(param).__name__} of shape "
                                 f"{tuple(param.shape)}; it takes a DTensor like the sharded parameter or the full "
                                 f"tensor subclass of shape {self.global_shape}")
            self.requires_grad = param.requires_grad
            self.set_extension_local(self._shard_subclass(param.detach()))
        self.requires_grad = self.sharded.requires_grad
        if self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)

    def _check_layout(self, param: DTensor) -> None:
        if (tuple(param.shape) != self.global_shape or tuple(param.placements) != tuple(self.placements)
                or not same_mesh(param.device_mesh, self.mesh)):
            raise ValueError(
                f"fully_shard: '{self.fqn}' was replaced by a DTensor of shape {tuple(param.shape)}, placements "
                f"{tuple(param.placements)} on mesh {param.device_mesh}; the unit shards it as shape "
                f"{self.global_shape}, placements {tuple(self.placements)} on mesh {self.mesh}. Build the new value "
                "with distribute_tensor(full, p.device_mesh, p.placements) from the sharded parameter p, or pass "
                "the full tensor.")

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(self.global_shape),
            stride=self.global_stride,
        )

    # -- unsharded storage (see [Note: freeing by storage resize]) ------------------------------
    def gather_inputs(self, mesh: DeviceMesh, mp_policy: object) -> list[torch.Tensor]:
        """This rank's all-gather pieces from ``fsdp_pre_all_gather`` (extension only)."""
        assert self.ext is not None
        return self.ext.pre(self.sharded_local(), mesh, self.uses[0][0], mp_policy)

    def rebuild_unsharded(self) -> None:
        """After the pieces were copied into ``ext.outputs``: ``fsdp_post_all_gather`` rebuilds
        the unsharded weight (in place after the first time)."""
        assert self.ext is not None
        built = self.ext.post(self.sharded_local(), self.compute_dtype, self.unsharded if self.ext.inner else None)
        if built is None:
            return
        if self.tp_mesh is not None:  # the TP-local unsharded weight, in its TP placements
            built = DTensor.from_local(built, self.tp_mesh, self.tp_placements, run_check=False,
                                       shape=torch.Size(self.global_shape), stride=self.global_stride)
        self.unsharded = nn.Parameter(built, requires_grad=self.requires_grad)

    def unsharded_data(self) -> torch.Tensor:
        """A writable alias of the unsharded parameter's (TP-local) data, outside autograd."""
        t: torch.Tensor = self.unsharded
        if isinstance(t, DTensor):  # a tensor-parallel parameter
            with torch.no_grad():
                t = t.to_local()
        return t.data

    @property
    def unsharded_allocated(self) -> bool:
        return self.unsharded_data().untyped_storage().size() > 0

    def alloc_unsharded(self) -> torch.Tensor:
        """Give the unsharded parameter its bytes back; returns a writable alias."""
        t = self.unsharded_data()
        if self.alias:
            return t
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)
        return t

    def free_unsharded(self) -> None:
        if self.ext is not None:
            self.ext.free()
        elif not self.alias:
            self.unsharded_data().untyped_storage().resize_(0)

    def take_unsharded_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The unsharded gradient as a plain (TP-local) tensor in ``dtype``, cleared from the
        unsharded parameter. A TP gradient is first redistributed to the parameter's TP
        placement (e.g. the all-reduce of a ``Partial`` gradient) in the dtype it was computed
        in, then cast to ``dtype``, as torch's FSDP2 does ([Note: sharding a tensor-parallel
        parameter] in ``_tp_param.py``)."""
        g = self.unsharded.grad
        self.unsharded.grad = None
        acc, self.accumulated_grad = self.accumulated_grad, None
        if acc is not None:  # [Note: accumulating in the reduce dtype]
            g = acc if g is None else acc.add_(g)
        if g is None or self.tp_mesh is None:
            return g
        assert isinstance(g, DTensor), "a tensor-parallel parameter's gradient is a DTensor"
        if tuple(g.placements) != self.tp_placements:
            g = g.redistribute(self.tp_mesh, self.tp_placements)
        return g.to_local().to(dtype)

    def stash_unsharded_grad(self, dtype: torch.dtype) -> None:
        """After a backward that does not reduce: move the unsharded gradient into the running
        sum in ``dtype`` if it is computed in another dtype ([Note: accumulating in the reduce
        dtype])."""
        g = self.unsharded.grad
        if g is None or g.dtype == dtype:
            return
        self.unsharded.grad = None
        with torch.no_grad():
            if self.accumulated_grad is None:
                self.accumulated_grad = g.to(dtype)
            else:
                self.accumulated_grad.add_(g)

    # -- which tensor the module sees ------------------------------------------------------------
    def register(self, unsharded: bool) -> None:
        p = self.unsharded if unsharded else self.sharded
        for module, name in self.uses:
            module._parameters[name] = p

    # -- gradients -------------------------------------------------------------------------
    def accumulate_sharded_grad(self, padded_grad: torch.Tensor) -> None:
        """Set (or add to) ``sharded.grad`` from this rank's reduced padded shard ``padded_grad``
        (cast to the original dtype and moved to the shard's device if needed; its own storage,
        [Note: ordinary tensors])."""
        device = self.padded.device
        local_grad = self.layout.local_view(padded_grad, self.shard_rank)
        if self.sharded.grad is None:
            padded_grad = padded_grad.to(device=device, dtype=self.orig_dtype)
            self.sharded.grad = self._as_dtensor(self.layout.local_view(ordinary(padded_grad), self.shard_rank))
        else:
            with torch.no_grad():
                grad = self.sharded.grad
                assert isinstance(grad, DTensor)
                grad.to_local().add_(local_grad.to(device))
