"""The per-module state of `replicate`: the buckets, the gradient hooks, the end of backward.

A post-accumulate-grad hook per parameter copies its gradient into its bucket and starts the full
buckets in order ([Note: replicate's buckets]); the first hook of a backward queues ``finish``,
which starts the rest, waits, divides and stores every ``.grad`` as a view (or None).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from .._compat import queue_backward_callback
from ._buckets import Bucket

__all__ = ["ReplicateState", "STATE_ATTR", "get_replicate_state"]

STATE_ATTR = "_shardwise_replicate_state"


class ReplicateState:
    """Settings (``sync``, ``divide_factor``, ``all_used``) and the step's bucket bookkeeping."""

    def __init__(self, buckets: list[Bucket], group: dist.ProcessGroup, world: int) -> None:
        self.buckets = buckets
        self.group = group
        self.world = world
        self.sync = True  # set_requires_gradient_sync
        self.divide_factor: float | None = None  # set_gradient_divide_factor; None: the world
        self.all_used = False  # set_reduce_scatter_unused_params
        self._active = False
        self._scale = 1.0
        self._next = 0  # the next bucket to start
        self._handles: list = []
        for b in buckets:
            for i, p in enumerate(b.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(b, i)))

    def _hook(self, b: Bucket, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.sync or param.grad is None:
                return
            if not self._active:
                self._begin()
            b.put(i, param.grad, self._scale)
            if len(b.ready) == len(b.params):
                self._start_full()
        return hook

    def _begin(self) -> None:
        self._active = True
        # divided while copied in (one pass less); the flags are written apart, undivided
        self._scale = 1.0 / float(self.world if self.divide_factor is None else self.divide_factor)
        self._next = 0
        for b in self.buckets:
            b.begin()
        queue_backward_callback(self.finish)

    def _start_full(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            with record_function("shardwise::replicate::all_reduce"):
                self.buckets[self._next].start(self.group)
            self._next += 1

    def finish(self) -> None:
        """End of backward: start what is left, wait, divide, store the gradients."""
        if not self._active:
            return
        self._active = False
        missing: list[tuple[Bucket, list[int]]] = []
        for b in self.buckets[self._next:]:
            gone = b.fill_missing(self.all_used, self._scale)
            if gone:
                missing.append((b, gone))
            with record_function("shardwise::replicate::all_reduce"):
                b.start(self.group, gone)
        self._next = len(self.buckets)
        for b in self.buckets:
            assert b.work is not None and b.buffer is not None
            b.work.wait()
        none: set[int] = set()
        if missing:  # one host read, only for parameters this rank had no gradient for
            counts = torch.cat([b.buffer[b.numel:][torch.tensor(gone)] for b, gone in missing  # type: ignore[index]
                                ]).tolist()
            at = 0
            for b, gone in missing:
                for i, c in zip(gone, counts[at:at + len(gone)]):
                    if c == 0:
                        none.add(id(b.params[i]))
                at += len(gone)
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                p.grad = None if none and id(p) in none else view
            b.release()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def get_replicate_state(module: nn.Module) -> ReplicateState | None:
    state = getattr(module, STATE_ATTR, None)
    return state if isinstance(state, ReplicateState) else None
