"""Gradient buckets of `replicate`: which parameter goes where, and one bucket's all-reduce.

[Note: replicate's buckets]
As DDP: the parameters needing gradients, in reverse registration order, split by dtype and
device, are cut into buckets of ``first_cap`` bytes (small, so communication starts early) then
``cap``; a parameter is never split. A bucket of ``n`` parameters is one flat buffer of ``numel +
n`` elements: the gradients, then one *used* flag per parameter ([Note: unused parameters] of
fully_shard), so after the sum every rank knows how many ranks used each, at no extra collective.
Buckets are all-reduced strictly in order, each as soon as it is full, so the collectives match
whatever order gradients arrive in. The buffer is reused across steps when nothing else holds its
storage (``.grad`` are views of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .._compat import storage_shared

__all__ = ["Bucket", "plan_buckets"]


@dataclass
class Bucket:
    """One flat all-reduce: ``params[i]`` at ``offsets[i]``; its flag at ``numel + i``."""

    dtype: torch.dtype
    device: torch.device
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # params[i]'s gradient in buffer
    ready: set[int] = field(default_factory=set)  # indices whose gradient is in the buffer
    work: dist.Work | None = None
    started: bool = False

    def begin(self) -> None:
        """A new backward: a buffer nobody else holds (and its per-parameter views), flags cleared."""
        self.views = []  # dropped at the end of each backward (`release`), so they do not count as users
        if self.buffer is None or storage_shared(self.buffer):
            self.buffer = torch.empty(self.numel + len(self.params), dtype=self.dtype, device=self.device)
        self.views = [self.buffer[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]
        self.ready.clear()
        self.work = None
        self.started = False

    def release(self) -> None:
        """End of backward, after ``.grad`` took its views: drop ours, so that the next `begin`
        sees whether anything else (a gradient kept) still uses the buffer."""
        self.views = []

    def region(self, i: int) -> torch.Tensor:
        return self.views[i]

    def put(self, i: int, grad: torch.Tensor, scale: float = 1.0) -> None:
        """This rank's gradient of ``params[i]``, times ``scale``, into the buffer (its flag is
        written at `start`). Scaling while copying saves a pass over the gradients (DDP does
        the same: the division by the world size happens here, before the sum)."""
        region = self.views[i]
        if region.data_ptr() == grad.data_ptr():
            if scale != 1.0:
                region.mul_(scale)
        elif scale != 1.0:
            torch.mul(grad, scale, out=region)
        else:
            region.copy_(grad)
        self.ready.add(i)

    def fill_missing(self, all_used: bool, scale: float = 1.0) -> list[int]:
        """End of backward: parameters with no gradient this backward. One still holding a
        ``.grad`` (accumulated while sync was off) sends it; the others send zeros with flag 0
        (flag 1 if ``all_used``: unused parameters then get zero gradients). Returns the
        indices this rank sent a 0 flag for."""
        missing = []
        for i, p in enumerate(self.params):
            if i in self.ready:
                continue
            if p.grad is not None:
                self.put(i, p.grad, scale)
                continue
            self.views[i].zero_()
            if not all_used:
                missing.append(i)
        return missing

    def start(self, group: dist.ProcessGroup, unflagged: list[int] | None = None) -> None:
        """Write the flags (1, but 0 at ``unflagged``) and start the sum over ``group``."""
        assert self.buffer is not None and not self.started
        flags = self.buffer[self.numel:]
        flags.fill_(1)
        if unflagged:
            flags[torch.tensor(unflagged)] = 0
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)
        self.started = True


def plan_buckets(params: list[nn.Parameter], cap: int, first_cap: int) -> list[Bucket]:
    """[Note: replicate's buckets]: ``params`` (registration order, no repeats) cut into buckets
    of at most ``first_cap`` bytes for the first and ``cap`` after (a parameter larger than a
    cap is a bucket of its own)."""
    buckets: list[Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    for p in reversed(params):
        key = (p.dtype, p.device)
        b = open_.get(key)
        limit = first_cap if b is not None and b is buckets[0] else cap
        if b is not None and b.params and (b.numel + p.numel()) * p.element_size() > limit:
            b = None
        if b is None:
            b = Bucket(p.dtype, p.device, [], [], 0)
            buckets.append(b)
            open_[key] = b
        b.params.append(p)
        b.offsets.append(b.numel)
        b.numel += p.numel()
    return buckets
