"""What one rank does in a pipeline step: an `Action` of an `ActionKind` on a stage (pure).

[Note: action kinds]
``F(s, i)``: forward of microbatch ``i`` on virtual stage ``s``. A backward is one full ``B(s, i)``
or split: ``I(s, i)``, the input gradient (what stage ``s - 1`` waits for), and ``W(s, i)``, the
parameter gradients (nothing waits for it; zero-bubble schedules fill idle time with it).
Dependencies: ``F(s, i)`` needs ``F(s - 1, i)``; ``B``/``I(s, i)`` need ``F(s, i)`` and the input
gradient of stage ``s + 1``; ``W(s, i)`` needs ``I(s, i)``. ``F`` keeps one microbatch of
activations alive; ``B`` or ``W`` frees it (``I`` frees nothing: ``W`` still needs the inputs).

Pairs: ``FB`` = ``Action.pair(F(s, i), B(t, j))``, a forward and a backward (``B`` or ``I``) of
two other (stage, microbatch)s on one rank listed as one action (DualPipe's overlapped chunks).
Its ``stage`` and ``microbatch`` are its forward's. A pair changes no dependency: each half waits
and is waited for as alone, so everything walking action lists walks ``a.halves`` (``(a,)`` for
any other action). The halves must not wait on each other, even through other ranks ([Note:
forward/backward pairs] in ``_pipeline/_runtime/_pipeline_schedule.py``); `simulate` and
`PipelineSchedule` refuse such a pair, and a pair inside a pair. Pairs are frozen and hashable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Action", "ActionKind"]


class ActionKind(str, enum.Enum):
    """The kind of an `Action`; a ``str`` enum, so ``ActionKind.F == "F"``. See [Note: action kinds]."""

    F = "F"  # forward
    B = "B"  # full backward (input and parameter gradients)
    I = "I"  # noqa: E741 - split backward, input gradient only
    W = "W"  # split backward, parameter gradients only
    FB = "FB"  # a pair: a forward and a backward (B or I) of another (stage, microbatch)

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
    """``kind`` (an `ActionKind`, or its letter) on virtual ``stage`` for ``microbatch``; for a
    pair (``FB``, made with `Action.pair`) also ``sub``, its forward and its backward."""

    kind: ActionKind
    stage: int
    microbatch: int
    sub: tuple[Action, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            try:
                kind = ActionKind(self.kind)
            except ValueError:
                raise ValueError(f"pipeline: action kind {self.kind!r} is unknown; use one of "
                                 f"{[k.value for k in ActionKind]}") from None
            object.__setattr__(self, "kind", kind)
        if self.kind is ActionKind.FB:
            f, b = self.sub if len(self.sub) == 2 else (None, None)
            if not (isinstance(f, Action) and isinstance(b, Action) and f.kind is ActionKind.F
                    and b.kind in (ActionKind.B, ActionKind.I)):
                raise ValueError(f"pipeline: a pair (FB) is a forward and a backward (B or I), got {self.sub!r}; "
                                 "make it with Action.pair(Action('F', s, i), Action('B', t, j))")
            if (f.stage, f.microbatch) == (b.stage, b.microbatch) or (self.stage, self.microbatch) != (
                    f.stage, f.microbatch):
                raise ValueError(f"pipeline: pair {f!r}&{b!r} is not a forward and a backward of two (stage, "
                                 "microbatch)s; make it with Action.pair(forward, backward) of different ones")
        elif self.sub:
            raise ValueError(f"pipeline: only a pair (FB) has sub-actions, not {self.kind.value}; use Action.pair")

    @classmethod
    def pair(cls, forward: Action, backward: Action) -> Action:
        """The ``FB`` action of ``forward`` (an ``F``) and ``backward`` (a ``B`` or an ``I``) of
        another (stage, microbatch) on the same rank. See [Note: action kinds]."""
        return cls(ActionKind.FB, forward.stage, forward.microbatch, (forward, backward))

    @classmethod
    def checked_already(cls, kind: ActionKind, stage: int, microbatch: int) -> Action:
        """``Action(kind, stage, microbatch)`` of an `ActionKind` other than ``FB``, without
        ``__post_init__``'s checks (for the ~10^5 actions of a list scheduler's play: twice as fast)."""
        a = object.__new__(cls)
        a.__dict__.update(kind=kind, stage=stage, microbatch=microbatch, sub=())
        return a

    @property
    def halves(self) -> tuple[Action, ...]:
        """A pair's forward and backward; ``(self,)`` for any other action."""
        return self.sub if self.kind is ActionKind.FB else (self,)

    def __repr__(self) -> str:
        if self.kind is ActionKind.FB:
            return "&".join(map(repr, self.sub))
        return f"{self.kind.value}{self.stage}.{self.microbatch}"
