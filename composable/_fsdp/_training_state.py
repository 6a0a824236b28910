"""`TrainingState`: what a unit is doing, and the transitions it may make (checked by
``FSDPState._set_training``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["TrainingState", "NEXT"]


class TrainingState(Enum):
    """What a unit is doing. IDLE -> FORWARD (pre-forward) -> IDLE (post-forward) ...
    -> BACKWARD (first pre-backward) -> IDLE (the root's end-of-backward callback). A forward
    in BACKWARD is a recomputation (activation checkpointing) and changes nothing."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


NEXT = {
    TrainingState.IDLE: (TrainingState.FORWARD, TrainingState.BACKWARD),
    # FORWARD -> FORWARD: a unit over several modules, or a module run again before its
    # post-forward (e.g. after an exception); FORWARD -> BACKWARD: backward inside a forward
    TrainingState.FORWARD: (TrainingState.FORWARD, TrainingState.IDLE, TrainingState.BACKWARD),
    TrainingState.BACKWARD: (TrainingState.BACKWARD, TrainingState.IDLE),
}
