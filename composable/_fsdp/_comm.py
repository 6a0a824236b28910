"""How one unit's collectives are issued: the communication protocols and per-unit options.

``AllGather`` and ``ReduceScatter`` are the protocols of FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``: ``allocate(size, *, dtype, device)`` for buffers and a ``__call__``
issuing the collective (objects written against torch's ABCs work unchanged). ``CommOptions``
holds what the ``FSDPModule`` setters change about a unit's collectives (``ParamGroup.comm``).

[Note: what a custom collective sees]
The all-gather moves the unit's flat ``uint8`` buffer ([Note: flat buffers] in
``_param_group.py``): ``allocate`` gets ``W * B`` bytes and the call gathers ``B`` bytes per rank
of ``group``. The reduce-scatter moves one bucket: per rank the padded gradient blocks, then one
*used* flag per parameter ([Note: unused parameters] in ``_reduce.py``); ``op`` is always
``ReduceOp.SUM`` and the division follows. Both are called with ``async_op=True`` and may return
a work handle (waited later, overlapping backward) or None (done on return).
"""

from __future__ import annotations

from typing import Any

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._mesh_utils import all_gather_single, reduce_scatter_single

__all__ = ["Comm", "AllGather", "ReduceScatter", "CommOptions", "all_gather", "send_buffer", "reduce_scatter"]


class Comm(ABC):
    """A collective that allocates its own buffers (``allocate``) and issues itself (``__call__``)."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``size`` for the collective: a plain ``torch.empty`` or a buffer of a pool."""


class AllGather(Comm):
    """``__call__(output_tensor, input_tensor, group, async_op)``: ``output_tensor`` (``W`` times
    the size of ``input_tensor``) = every rank's ``input_tensor`` of ``group``, rank-major."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None: ...


class ReduceScatter(Comm):
    """``__call__(output_tensor, input_tensor, group, op, async_op)``: on rank ``r``,
    ``output_tensor`` = ``op`` over the ranks of ``group`` of chunk ``r`` of their ``input_tensor``."""

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None: ...


@dataclass
class CommOptions:
    """What the ``FSDPModule`` setters change about one unit's collectives (mutable: setters take
    effect at the next collective).

    ``gradient_divide_factor``: gradients are the sum over ranks divided by this (None: by the
    data-parallel size, the mean). ``force_sum``: the reduction hook sees sums, divided after
    it (default: divided before it). ``all_reduce_hook``: called on each reduced bucket's
    gradient elements (after the reduce-scatter on a 1-D mesh, after the replica all-reduce on
    a 2-D one), in place. ``reduce_scatter_group``: a separate group over the shard ranks
    (None: the all-gathers' group). ``max_input_buffers``: reduce-scatters of this root that
    may be in flight at once, each holding its send buffer. ``pg_allocate`` / ``symm_mem``:
    recorded CUDA-only switches (see docs/fully_shard.md)."""

    all_gather_comm: Any = None  # an AllGather (protocol above), or None
    reduce_scatter_comm: Any = None  # a ReduceScatter, or None
    reduce_scatter_group: dist.ProcessGroup | None = None
    gradient_divide_factor: float | None = None
    force_sum: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    max_input_buffers: int = 1
    pg_allocate: bool = False
    symm_mem: str | None = None


def all_gather(opts: CommOptions, numel: int, src: torch.Tensor, group: dist.ProcessGroup,
               device: torch.device, default: Callable = all_gather_single) -> tuple[dist.Work | None, torch.Tensor]:
    """Issue the all-gather of ``src`` over ``group`` into ``numel`` new bytes; ``(work, output)``.
    ``default`` issues it when no custom all-gather is set (the caller's name for it, so that
    tests can count the calls there)."""
    comm = opts.all_gather_comm
    if comm is None:
        out = torch.empty(numel, dtype=torch.uint8, device=device)
        return default(out, src, group=group, async_op=True), out
    out = comm.allocate((numel,), dtype=torch.uint8, device=device)
    return comm(output_tensor=out, input_tensor=src, group=group, async_op=True), out


def send_buffer(opts: CommOptions, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter's input buffer of ``numel`` elements."""
    comm = opts.reduce_scatter_comm
    if comm is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return comm.allocate((numel,), dtype=dtype, device=device)


def reduce_scatter(opts: CommOptions, send: torch.Tensor, out_numel: int, group: dist.ProcessGroup,
                   default: Callable = reduce_scatter_single) -> tuple[dist.Work | None, torch.Tensor]:
    """Issue the sum reduce-scatter of ``send`` over ``group`` (``opts.reduce_scatter_group``
    when set); ``(work, output)``. ``default``: as for ``all_gather``."""
    comm = opts.reduce_scatter_comm
    group = opts.reduce_scatter_group or group
    if comm is None:
        out = torch.empty(out_numel, dtype=send.dtype, device=send.device)
        return default(out, send, group=group, async_op=True), out
    out = comm.allocate((out_numel,), dtype=send.dtype, device=send.device)
    return comm(output_tensor=out, input_tensor=send, group=group, op=dist.ReduceOp.SUM, async_op=True), out
