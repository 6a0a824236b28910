"""The cp ring's transport: each step sends a buffer to rank ``(r + 1) % n`` and receives rank
``(r - 1) % n``'s, asynchronously; two streams (keys/values, their gradients) each have a tag, and
every rank issues them in the same order (all NCCL needs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Ring", "InFlight"]


@dataclass
class InFlight:
    """One exchange posted by `Ring.exchange`: ``wait()`` returns the received buffer."""

    recv: torch.Tensor
    works: list = field(default_factory=list)
    send: torch.Tensor | None = None  # kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works, self.send = [], None
        return self.recv


class Ring:
    """The ring over a cp process group (``group=None``: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group is not None else \
            (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group is not None else \
            (self.rank - 1) % self.size

    def source(self, step: int) -> int:
        """The cp rank whose buffer this rank holds after ``step`` exchanges."""
        return (self.rank - step) % self.size

    def exchange(self, send: torch.Tensor, tag: int) -> InFlight:
        """Post ``send`` to the next rank and a receive of the same shape from the previous."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return InFlight(recv, list(dist.batch_isend_irecv(ops)), send)
