"""What one rank does in a pipeline step: an `Action` of an `ActionKind` on a stage (pure).

[Note: action kinds]
``F(s, i)``: forward of microbatch ``i`` on virtual stage ``s``. A backward is either one full
``B(s, i)`` or split in two: ``I(s, i)``, the gradient with respect to the stage's input (what
stage ``s - 1`` waits for), and ``W(s, i)``, the gradients of the stage's parameters (nothing
waits for it; zero-bubble schedules put it where a rank would otherwise idle). Dependencies:

* ``F(s, i)`` needs ``F(s - 1, i)``;
* ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` and the input gradient of stage ``s + 1``
  (``B(s + 1, i)`` or ``I(s + 1, i)``);
* ``W(s, i)`` needs ``I(s, i)``.

Activations: ``F`` keeps one microbatch of the stage's activations alive, ``B`` frees it. ``I``
frees nothing in this model (its ``W`` still needs the saved inputs of the stage's layers) and
``W`` frees it, so a split backward is planned as holding its activations until ``W``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Action", "ActionKind"]


class ActionKind(str, enum.Enum):
    """The kind of an `Action`; a ``str`` enum, so ``ActionKind.F == "F"``. See [Note: action kinds]."""

    F = "F"  # forward
    B = "B"  # full backward (input and parameter gradients)
    I = "I"  # noqa: E741 - split backward, input gradient only
    W = "W"  # split backward, parameter gradients only

    @property
    def is_forward(self) -> bool:
        return self is ActionKind.F

    @property
    def gives_input_grad(self) -> bool:
        """Whether the action produces the gradient that stage ``s - 1`` receives (B or I)."""
        return self in (ActionKind.B, ActionKind.I)

    @property
    def frees_activations(self) -> bool:
        """Whether the action releases the microbatch's saved activations (B or W)."""
        return self in (ActionKind.B, ActionKind.W)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` (an `ActionKind`, or its letter) on virtual ``stage`` for ``microbatch``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            try:
                kind = ActionKind(self.kind)
            except ValueError:
                raise ValueError(f"pipeline: action kind {self.kind!r} is unknown; use one of "
                                 f"{[k.value for k in ActionKind]}") from None
            object.__setattr__(self, "kind", kind)

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"
