"""A unit's parameters replaced or read from outside a step (``load_state_dict``,
``state_dict()``, ``module._apply``): the mark an adopted parameter carries, the reshard before
the update, and the re-adoption after it ([Note: re-adopting parameters])."""

from __future__ import annotations

from ._state import FSDPState, TrainingState

__all__ = ["OWNER_ATTR", "reshard_for_update", "readopt"]

OWNER_ATTR = "_shardwise_sharded_as"  # set on an original parameter once a unit took it


def reshard_for_update(state: FSDPState, what: str) -> None:
    """Reshard the unit before ``what`` replaces or reads its parameters (between steps only)."""
    g = state.group
    if g is None or not (g.is_unsharded or g.unshard_pending):
        return
    if state.training is TrainingState.BACKWARD:
        raise RuntimeError(f"fully_shard({g.label}): {what} during backward; call it between steps")
    g.reshard()


def readopt(state: FSDPState) -> None:
    """Re-adopt the parameters the unit's modules hold now ([Note: re-adopting parameters])."""
    if state.group is None:
        return
    state.group.readopt()
    for sp in state.group.params:  # swap_tensors swaps __dict__ too: put the mark back
        if getattr(sp.sharded, OWNER_ATTR, None) is None:
            setattr(sp.sharded, OWNER_ATTR, sp.owner)
