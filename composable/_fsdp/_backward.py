"""The backward half of a unit's hooks: steps 3 to 5 of [Note: the life of one training step]
(``_state.py``): the post-backward autograd function put around a unit's inputs in forward,
the pre-backward hook on its outputs, the reduction once every forward call of the unit has
seen its backward, and the end-of-step reset. `FSDPState` derives from `BackwardHooks`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._compat import tree_flatten, tree_unflatten
from ._root import RootContext
from ._training_state import TrainingState

__all__ = ["BackwardHooks"]


class _PostBackward(torch.autograd.Function):
    """Identity in forward; in backward, tells the unit that one of its forward calls is done."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._post_backward_fired()
        return (None, *grads)


class BackwardHooks:
    """Mixin of `FSDPState`: its backward hooks. The attributes below are ``FSDPState``'s."""

    if TYPE_CHECKING:
        group: Any
        ctx: RootContext | None
        training: TrainingState
        requires_all_reduce: bool
        unshard_in_backward: bool
        backward_prefetch: list | None
        _pending_post_backward: int
        _forward_seen: set[int]

        @property
        def reshard_after_backward(self) -> bool: ...

        @property
        def requires_gradient_sync(self) -> bool: ...

        def _set_training(self, new: TrainingState) -> None: ...

        def _prefetch(self, states, backward: bool = False) -> None: ...

        def _neighbour(self, step: int) -> list: ...

    def _register_post_backward(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        self._pending_post_backward += 1
        return tree_unflatten(flat, spec)

    def _pre_backward(self, grad):
        self.ctx.start_backward()
        self._set_training(TrainingState.BACKWARD)
        if self.group is not None and self.unshard_in_backward:
            self.group.unshard()
        self._prefetch(self.backward_prefetch if self.backward_prefetch is not None else self._neighbour(-1),
                       backward=True)
        return None

    def _post_backward_fired(self) -> None:
        self._pending_post_backward -= 1
        if self._pending_post_backward <= 0:
            self._pending_post_backward = 0
            # free the unsharded parameters before the reduce-scatter allocates its send
            # buffer: the gradients and that buffer then never coexist with them
            if self.group is not None and self.reshard_after_backward:
                self.group.reshard()
            self._reduce()

    def _reduce(self) -> None:
        if self.group is None:
            return
        if not self.requires_gradient_sync:
            self.group.stash_unsharded_grads()
            return
        assert self.ctx is not None, "a backward runs after lazy init"
        issued = self.group.reduce_grads(all_reduce=self.requires_all_reduce,
                                         replica_buckets=self.ctx.replica_buckets)
        if issued:
            self.ctx.keep_in_flight(issued)

    def _end_step(self) -> None:
        """Called by the root's end-of-backward callback on every unit: resharded (unless
        ``reshard_after_backward=False``), per-step state reset."""
        self._pending_post_backward = 0
        self._forward_seen.clear()
        self.training = TrainingState.IDLE  # from any state: the step is over
        if self.group is not None:
            self.group.wait_unshard()
            if self.reshard_after_backward:
                self.group.reshard()
            self.group.drop_post_forward()
