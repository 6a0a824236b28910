"""The state only the root unit has: one ``RootContext`` shared by every unit under it.

The root (the first unit to run forward) collects the units under it at lazy init; what spans
units lives here: the units in forward order, the prefetch limit, the reductions in flight, the
end-of-backward callback, the subgroups of an int ``reshard_after_forward``.

[Note: backwards that are not the last]
``set_is_last_backward(False)`` (FSDP2's microbatching switch) leaves a backward's reductions in
flight at its end, overlapping the next microbatch's forward; the next backward moves them on,
and a backward with ``is_last_backward`` True (the default) finishes them all. Set it True
again before the step's last backward: gradients are complete only after that one.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .._compat import queue_backward_callback
from ._bucket import ReplicaBuckets
from ._reduce import PendingReduce, ReduceStage, resolve_unused

__all__ = ["RootContext", "DEFAULT_UNSHARD_LIMIT"]

DEFAULT_UNSHARD_LIMIT = 2  # see [Note: the unshard limit] in _state.py


class RootContext:
    """Bookkeeping of one root and the units under it (``states``, root first; each an
    ``FSDPState``, driven through its handle methods ``reduce`` and ``end_step``)."""

    def __init__(self, root: Any, states: list[Any], unshard_limit: int) -> None:
        self.root = root
        self.states = states
        self.unshard_limit = unshard_limit
        self.order: list[Any] = []  # forward order of the previous step
        self.this_order: list[Any] = []  # forward order of this step so far
        self.reduces: list[PendingReduce] = []  # in flight, oldest first
        self.done: list[PendingReduce] = []  # of this backward already stored (for resolve_unused)
        self.callback_queued = False  # the end-of-backward callback of this step is queued
        self.thread: int | None = None  # the thread that ran the root's last forward (it trains)
        # set_is_last_backward(False): this backward's end leaves its reductions in flight
        # (finished by the next last backward), see [Note: backwards that are not the last]
        self.is_last_backward = True
        self.post_optim_event: object = None  # set_post_optim_event: waited for at the next root forward
        self.replica_buckets = ReplicaBuckets()  # NO_SHARD's all-reduces, see _bucket.py
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # rank set -> group

    def subgroup(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group over ``ranks``, made once (collective over those ranks)."""
        if ranks not in self._subgroups:
            self._subgroups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return self._subgroups[ranks]

    def busy_units(self) -> int:
        """Resharding units now unsharded or being all-gathered ([Note: the unshard limit])."""
        return sum(
            1 for t in self.states
            if t.group is not None and t.reshard_after_forward is not False
            and (t.group.is_unsharded or t.group.unshard_pending)
        )

    def start_backward(self) -> None:
        """At the first pre-backward hook of a step: keep this step's forward order for the
        next step's prefetches and queue the end-of-backward callback (once)."""
        if not self.callback_queued:
            self.callback_queued = True
            self.order = list(self.this_order)
            queue_backward_callback(self.final_callback)

    def keep_in_flight(self, issued: list[PendingReduce]) -> None:
        """Add a unit's newly issued reductions, moving the earlier ones a stage on
        (reduce-scatter -> replica all-reduce -> stored) so that they run behind the computation."""
        limit = issued[0].group.comm.max_input_buffers if issued else 1
        earlier, self.reduces = self.reduces, []
        scattering = sum(pr.stage is ReduceStage.SCATTER and not pr.bucketed for pr in earlier)
        for pr in earlier:
            if pr.bucketed:  # its bucket's all-reduce runs behind the backward until its end
                self.reduces.append(pr)
                continue
            if pr.stage is ReduceStage.SCATTER:
                if scattering < limit:  # set_reduce_scatter_max_input_buffers: may stay in flight
                    self.reduces.append(pr)
                    continue
                scattering -= 1
            (self.done if pr.advance() else self.reduces).append(pr)
        self.reduces.extend(issued)

    def final_callback(self) -> None:
        """End of ``loss.backward()``: units whose post-backward never fired reshard and reduce;
        every reduction finishes; every unit is resharded and its per-step state reset."""
        for s in reversed(self.states):
            if s.group is not None and s.group.has_unsharded_grads():
                if s.reshard_after_backward:
                    s.group.reshard()  # as in the post-backward: parameters go first
                s.reduce()
        self.replica_buckets.end_backward()
        if self.is_last_backward:
            while self.reduces:
                pr = self.reduces.pop(0)
                pr.finish()
                self.done.append(pr)
            done, self.done = self.done, []
            resolve_unused(done)  # [Note: unused parameters] in _reduce.py
        for s in self.states:
            s.end_step()
        self.callback_queued = False

    def reset(self) -> None:
        """``FSDPModule.reset_iter_state``: after an exception in forward or backward, the step is
        abandoned (``abandon_step``) and every unit resharded, whatever its settings."""
        self.abandon_step()
        self.this_order = []
        for s in self.states:
            if s.group is not None:
                s.group.reshard()
                s.group.drop_post_forward()
                for b in s.group.buckets:
                    b.partial_over_replicas = False

    def abandon_step(self) -> None:
        """Clean up after a backward that raised (see [Note: a backward that raised] in
        ``_state.py``): the reductions it issued are waited for and dropped, never stored;
        every unit's unsharded gradients are dropped, its parameters resharded as at the end
        of a backward and its per-step state reset. Nothing of the broken step reaches
        ``.grad`` through this call."""
        for pr in self.reduces:
            if pr.work is not None:  # every rank issued it: wait, so the collectives stay matched
                pr.work.wait()
        self.reduces, self.done = [], []
        self.replica_buckets.drop()
        for s in self.states:
            if s.group is not None:
                s.group.drop_unsharded_grads()
            s.end_step()
        self.callback_queued = False
