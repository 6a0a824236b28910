"""One all-to-all of tensors of any shapes and dtypes over a group: the owner step's gather and
scatter.

Both sides know every tensor's shape and dtype ([Note: owners of whole matrices] in
``_owners.py``). The tensors travel as bytes in one flat buffer per direction, each padded to
``ALIGN`` (``shardwise.mesh.byte_layout``, the one packer), so every received tensor is a view of
the buffer in its own dtype: one collective whatever the dtypes, no copy out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.mesh import byte_layout

from .._mesh_utils import all_to_all_single

__all__ = ["ALIGN", "Spec", "PendingExchange", "start_exchange"]

ALIGN = 16  # bytes; a multiple of every dtype's size
Spec = tuple[torch.Size, torch.dtype]


def _layout(specs: list[Spec]) -> tuple[list[int], int]:
    return byte_layout([shape.numel() * dtype.itemsize for shape, dtype in specs], ALIGN)


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    offsets, total = _layout([(t.shape, t.dtype) for t in tensors])
    out = torch.empty(total, dtype=torch.uint8, device=device)
    for t, o in zip(tensors, offsets):
        if t.numel():
            out[o:o + t.numel() * t.dtype.itemsize].view(t.dtype).view(t.shape).copy_(t)
    return out


class PendingExchange:
    """An exchange in flight; `wait` returns, per source group rank, its tensors in order."""

    def __init__(self, work: dist.Work | None, buffer: torch.Tensor, recv: list[list[Spec]],
                 sent: torch.Tensor | None) -> None:
        self._work, self._buffer, self._recv, self._sent = work, buffer, recv, sent

    @property
    def sent_bytes(self) -> int:
        return 0 if self._sent is None else self._sent.numel()

    def wait(self) -> list[list[torch.Tensor]]:
        if self._work is not None:
            self._work.wait()
        self._sent = None
        flat = [spec for specs in self._recv for spec in specs]
        views = iter([self._buffer[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                      for o, (shape, dtype) in zip(_layout(flat)[0], flat)])
        return [[next(views) for _ in specs] for specs in self._recv]


def start_exchange(send: list[list[torch.Tensor]], recv: list[list[Spec]], group: dist.ProcessGroup | None,
                   device: torch.device) -> PendingExchange:
    """Send ``send[r]`` to group rank ``r`` and receive ``recv[s]`` (shapes and dtypes) from each
    rank ``s``, asynchronously. With no group (a group of one) the tensors are handed over as
    they are."""
    if group is None:
        buffer = _pack([t for ts in send for t in ts], device)
        return PendingExchange(None, buffer, recv, None)
    sent = _pack([t for ts in send for t in ts], device)
    in_splits = [_layout([(t.shape, t.dtype) for t in ts])[1] for ts in send]
    out_splits = [_layout(specs)[1] for specs in recv]
    buffer = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    work = all_to_all_single(buffer, sent, out_splits, in_splits, group=group, async_op=True)
    return PendingExchange(work, buffer, recv, sent)
