"""``ReplicateModule``: the methods a module passed to `replicate` gains.

They carry the names of FSDP2's ``FSDPModule`` methods where the meaning carries over, so
code that accumulates with ``set_requires_gradient_sync(False)`` or sets a divide factor runs
unchanged on a replicated model; ``unshard`` / ``reshard`` are accepted and do nothing (the
parameters are always whole).
"""

from __future__ import annotations

from ._state import ReplicateState, get_replicate_state

__all__ = ["ReplicateModule"]


class ReplicateModule:
    """Mixin added to the class of a module passed to `replicate`."""

    def _replicate_state(self) -> ReplicateState:
        state = get_replicate_state(self)  # type: ignore[arg-type]
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no replicate state; call replicate on it")
        return state

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward only accumulates this rank's gradients into ``.grad`` (DDP's
        ``no_sync``); the next backward with True all-reduces the accumulated sum."""
        self._replicate_state().sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """The same as `set_requires_gradient_sync` here: the all-reduce is the only reduction."""
        self.set_requires_gradient_sync(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted; every backward ends by itself here (no state to keep for the next one)."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients become sum / ``factor`` instead of sum / world size."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor}")
        self._replicate_state().divide_factor = float(factor)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a parameter no rank used gets a zero gradient instead of None (FSDP2's flag)."""
        self._replicate_state().all_used = bool(reduce_scatter_unused_params)

    def unshard(self, async_op: bool = False) -> None:
        """Accepted; the parameters are always whole. Returns None (nothing to wait for)."""
        return None

    def reshard(self) -> None:
        """Accepted; nothing to free."""

    def set_unshard_limit(self, limit: int) -> None:
        """Accepted; there are no unshards to limit."""

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """Accepted; nothing is resharded."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Accepted; nothing is resharded."""

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Accepted; there is nothing to prefetch."""

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Accepted; there is nothing to prefetch."""
