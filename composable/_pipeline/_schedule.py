"""Pipeline schedules as per-rank action lists, and a simulator that checks and times them (pure).

[Note: schedules]
A pipeline of ``S = pp * v`` stages runs ``m`` microbatches; stage ``s`` lives on rank
``s % pp`` (``v`` virtual stages per rank, "interleaved" when ``v > 1``). An action is
``F(s, i)`` (forward of microbatch ``i`` on stage ``s``) or ``B(s, i)`` (its backward). Its
dependencies: ``F(s, i)`` needs ``F(s-1, i)``; ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)``.
Each rank runs its list in order; sends never block (they are asynchronous), a receive waits
for the producing action. `simulate` replays that rule with unit times and so proves a
schedule deadlock-free and gives its bubble: with forward time 1 and backward time 2, GPipe
and 1F1B take ``3 (m + p - 1)`` per step, bubble ``(p - 1) / (m + p - 1)``; interleaving
divides the bubble by about ``v``.

* ``gpipe``: all forwards, then all backwards. Keeps ``m`` microbatches of activations.
* ``1f1b``: ``p - r - 1`` warm-up forwards on rank ``r``, then one forward / one backward
  alternately, then the remaining backwards. Same bubble, at most ``p`` microbatches alive.
* ``interleaved_1f1b`` (``v >= 2``; ``m`` a multiple of ``pp``): the forward order of a rank
  walks its ``v`` stages in rounds of ``pp`` microbatches; warm-up ``(pp - r - 1) * 2 +
  (v - 1) * pp`` forwards, then 1F1B, the backward order walking the stages in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "SCHEDULES", "build_schedule", "simulate", "theoretical_bubble"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` "F" or "B" on virtual ``stage`` for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


def _check(schedule: str, pp: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
    if pp < 1 or v < 1:
        raise ValueError(f"pipeline: pp={pp} and virtual stages v={v} must be >= 1")
    if m < 1:
        raise ValueError(f"pipeline: microbatches={m}; it must be >= 1")
    if schedule == "interleaved_1f1b" and m % pp:
        raise ValueError(f"pipeline: interleaved_1f1b needs microbatches ({m}) to be a multiple of pp ({pp}); "
                         f"use {-(-m // pp) * pp} microbatches, or schedule='1f1b'")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"pipeline: schedule={schedule!r} runs one stage per rank but {v} virtual stages were "
                         "requested; use schedule='interleaved_1f1b' or virtual_stages=1")


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The action list of every rank (index = rank on the ``pp`` axis). See [Note: schedules]."""
    m, v = microbatches, virtual_stages
    _check(schedule, pp, m, v)
    out = []
    for r in range(pp):
        if schedule == "gpipe":
            acts = [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        elif schedule == "1f1b":
            warm = min(pp - r - 1, m)
            fw = [Action("F", r, i) for i in range(m)]
            bw = [Action("B", r, i) for i in range(m)]
            acts = fw[:warm]
            for k in range(m - warm):
                acts += [fw[warm + k], bw[k]]
            acts += bw[m - warm:]
        else:
            acts = _interleaved(r, pp, m, v)
        out.append(acts)
    return out


def _interleaved(r: int, pp: int, m: int, v: int) -> list[Action]:
    total = m * v

    def fwd(k: int) -> Action:
        chunk = (k // pp) % v
        return Action("F", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action("B", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    acts = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        acts += [fwd(warm + k), bwd(k)]
    acts += [bwd(k) for k in range(total - warm, total)]
    return acts


def simulate(actions: list[list[Action]], num_stages: int, microbatches: int, *, f_time: float = 1.0,
             b_time: float = 2.0) -> tuple[float, list[float]]:
    """Run the per-rank lists with the dependency rule of [Note: schedules]; return the makespan
    and each rank's busy time. Raises ``ValueError`` on a deadlock, a missing or repeated action."""
    want = {Action(k, s, i) for k in "FB" for s in range(num_stages) for i in range(microbatches)}
    got = [a for acts in actions for a in acts]
    if len(got) != len(set(got)) or set(got) != want:
        raise ValueError("schedule does not run every F and B of every stage and microbatch exactly once")
    done: dict[Action, float] = {}
    pos = [0] * len(actions)
    clock = [0.0] * len(actions)
    busy = [0.0] * len(actions)
    remaining = len(got)
    while remaining:
        progressed = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = []
                if a.kind == "F" and a.stage > 0:
                    deps.append(Action("F", a.stage - 1, a.microbatch))
                if a.kind == "B":
                    deps.append(Action("F", a.stage, a.microbatch))
                    if a.stage < num_stages - 1:
                        deps.append(Action("B", a.stage + 1, a.microbatch))
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                cost = f_time if a.kind == "F" else b_time
                done[a] = clock[r] = start + cost
                busy[r] += cost
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in enumerate(actions) if pos[r] < len(acts)}
            raise ValueError(f"schedule deadlocks: ranks wait on {stuck}")
    return max(clock), busy


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: idle fraction of a rank (equal forward/backward split per stage)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)
