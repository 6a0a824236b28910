"""Running a forward/backward pair (``FB``) of a pipeline step, and the user's overlap function.

[Note: forward/backward pairs]
A pair ([Note: action kinds] in ``_actions.py``) is a forward and a backward of two (stage,
microbatch)s on one rank, listed as one action so that they can overlap (DualPipe runs one
half's all-to-all during the other's compute). Its halves must not wait on each other, even
through other ranks: `simulate` with the halves run together (``overlap``) must not deadlock;
`PipelineSchedule` checks that when it is built (the same on every rank) and refuses the
schedule otherwise. So either half can go first, and both inputs can be taken before either runs.

Without an overlap function the halves run one after the other, the one whose input is there
first going first: an input that is local (a hand-off from this rank's other stage, or none:
the first stage's forward, the last stage's backward) or already received; else, where both
come from one peer, the one it sends first (it sends in its list's order); else (two peers,
with receives posted ahead, gloo: [Note: receiving ahead] in ``_p2p.py``) whichever arrives
first (`P2P.wait_first`, [Note: waiting for the first arrival] in ``_arrival.py``); with
nothing posted ahead (NCCL) the forward. Ties go to the forward. So the order is fixed wherever
the messages fix it, and otherwise only changes which of two independent computations comes
first (no number changes: the halves touch different stages).
Each half's output is sent when that half ends: with the other half's receive, in one group, if
that one still has to wait for it, or at once; a message to the peer that the forward also sends
to waits for the forward's ([Note: sends held back] in ``_p2p.py``).

Overlap function (``PipelineSchedule(..., overlap=fn)``, like torch's
``register_custom_function(OVERLAP_F_B, fn)``): ``fn(pair)`` is called once per pair, after both
halves' inputs have been taken, with a `PairHalves`: ``pair.action`` (the ``FB`` action),
``pair.forward()`` and ``pair.backward()``, each of which runs its half (compute, then its
output sent or handed on) and must be called exactly once, from the calling thread, in either
order; between or around them ``fn`` may do anything that leaves the numbers alone (enter a CUDA
stream, split its own communication, record events). ``fn`` returning without running both, or
running one twice, fails the step on every rank (`PipelineError`) naming the pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ._actions import Action, ActionKind
from ._bodies import ActionBodies
from ._split import StageShell
from ._step_state import StepState

__all__ = ["OverlapFn", "PairHalves", "PairRunner"]


@dataclass
class PairHalves:
    """What an overlap function gets for one pair: see [Note: forward/backward pairs]."""

    action: Action
    forward: Callable[[], None]
    backward: Callable[[], None]
    ran: list[str] = field(default_factory=list)


OverlapFn = Callable[[PairHalves], None]


class PairRunner(ActionBodies):
    """``_pair``: one ``FB`` action; see [Note: forward/backward pairs]."""

    stages: dict[int, StageShell]
    S: int
    overlap: OverlapFn | None
    last_pair_order: list[tuple[Action, Action]]

    def _source(self, h: Action) -> tuple[str, tuple, int]:
        """Where half ``h``'s input comes from: ``("none" | "local" | "peer", key, peer rank)``."""
        if h.kind is ActionKind.F:
            key, src = ("act", h.stage, h.microbatch), h.stage - 1
            if h.stage == 0:
                return "none", key, -1
        else:
            key, src = ("grad", h.stage, h.microbatch), h.stage + 1
            if h.stage == self.S - 1:
                return "none", key, -1
        peer = self._rank_of(src)
        return ("local" if peer == self.split.pp_rank else "peer"), key, peer

    def _there(self, h: Action, step: StepState) -> bool:
        where, key, peer = self._source(h)
        if where != "peer" or key in step.local:
            return True
        assert self.p2p is not None
        return self.p2p.arrived(peer, key)

    def _first_half(self, a: Action, step: StepState) -> int:
        """Which half (0: the forward, 1: the backward) runs first."""
        for n, h in enumerate(a.halves):
            if self._there(h, step):
                return n
        (_, kf, pf), (_, kb, pb) = (self._source(h) for h in a.halves)
        assert self.p2p is not None, "both halves wait for a peer"
        if pf == pb:
            return 0 if self.p2p.sent_before(pf, kf, kb) else 1
        if not self.p2p.ahead:
            return 0
        self.p2p.flush()  # nothing of ours may wait while we wait
        return self.p2p.wait_first([(pf, kf), (pb, kb)])

    def _pair(self, idx: int, a: Action, st: StageShell, step: StepState) -> None:
        run = {ActionKind.F: self._forward, ActionKind.B: self._backward, ActionKind.I: self._input_grad}
        if self.overlap is not None:
            self._overlapped(idx, a, step, run)
            return
        first = self._first_half(a, step)
        one, two = a.halves[first], a.halves[1 - first]
        self.last_pair_order.append((one, two))
        run[one.kind](idx, one, self.stages[one.stage], step)
        where, key, peer = self._source(two)
        if self.p2p is not None and (where != "peer" or key in step.local or self.p2p.arrived(peer, key)):
            self.p2p.flush()  # else the receive of `two` sends the output of `one` in its group
        run[two.kind](idx, two, self.stages[two.stage], step)

    def _overlapped(self, idx: int, a: Action, step: StepState, run: dict) -> None:
        for h in sorted(a.halves, key=lambda h: 0 if self._there(h, step) else 1):
            where, key, peer = self._source(h)
            if where == "peer" and key not in step.local:
                step.local[key] = self._get(key, h.stage - 1 if h.kind is ActionKind.F else h.stage + 1, step.local)

        def half(n: int, name: str) -> Callable[[], None]:
            def go() -> None:
                h = a.halves[n]
                if name in halves.ran:
                    raise RuntimeError(f"the overlap function ran the {name} {h!r} of pair {a!r} twice; run "
                                       "pair.forward() and pair.backward() once each")
                halves.ran.append(name)
                run[h.kind](idx, h, self.stages[h.stage], step)
                if self.p2p is not None:
                    self.p2p.flush()
            return go

        halves = PairHalves(a, half(0, "forward"), half(1, "backward"))
        assert self.overlap is not None
        self.overlap(halves)
        step.current = a
        missing = [n for n in ("forward", "backward") if n not in halves.ran]
        if missing:
            raise RuntimeError(f"the overlap function returned without running the {' and '.join(missing)} of pair "
                               f"{a!r}; it must call pair.forward() and pair.backward() once each")
        self.last_pair_order.append((a.halves[0], a.halves[1]) if halves.ran[0] == "forward"
                                    else (a.halves[1], a.halves[0]))
