"""Zero-bubble lists fitted to measured action times: `tune_schedule` (pure).

[Note: schedules tuned to measured costs]
The registered zero-bubble lists assume ``F = I = W``; real stages differ (the first stage's
``I`` is empty and its ``W`` the whole backward, the last carries head and loss), and `simulate`
with measured costs (`PipelineSchedule.last_action_times`) finds shorter orders (torch's
``ScheduleInterleavedZeroBubble`` order simulated 10% shorter than our unit-time list on the
example Llama at p=2, m=4).

`tune_schedule` plays the list scheduler of [Note: greedy zero-bubble lists] with the measured
``costs`` (and ``comm_time``) under each preference in `PREFERENCES`, with and without a slot
reserved under the cap for later stages (else measured times may fill the cap with first-stage
forwards and stall), keeps the schedule's activation cap, and returns the candidate with the
shortest `simulate` makespan, the registered list being a candidate too. A local search then
swaps neighbouring actions while the makespan falls (`_swap_search`; swaps that deadlock or break
the cap are refused; at most `MAX_SWAP_TRIALS` simulations, a count so every rank ends alike).
Ties go to the earlier candidate, so ranks given the same costs (``retune`` in
``_pipeline/_runtime/_tune.py`` gathers them) pick the same lists. Placement and stages per rank
are kept, and `simulate` checks the result complete and deadlock-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ._actions import Action, ActionKind
from ._registry import ScheduleSpec, get_schedule
from ._simulate import simulate
from ._schedule_greedy import PREFERENCES, greedy_plays
from ._schedule_zbv import izb_cap, zbv_cap

__all__ = ["PREFERENCES", "TUNABLE_SCHEDULES", "tune_schedule"]


def _caps(name: str, pp: int, m: int, v: int) -> tuple[str, Callable[[int], int]]:
    if name == "zbv":
        return "v", zbv_cap(pp, m, v)
    if name == "interleaved_zb":
        return "loop", izb_cap(pp, m, v)
    return "loop", lambda r: pp  # zb_h1: at most p microbatches alive, 1F1B's worst rank


TUNABLE_SCHEDULES = ("zb_h1", "zbv", "interleaved_zb")
"""The schedules `tune_schedule` can refit (list-scheduled ones and ZB-H1, with their caps)."""


def tune_schedule(schedule: str | ScheduleSpec, pp: int, microbatches: int, virtual_stages: int,
                  costs: Mapping[tuple[str, int], float], *, comm_time: float = 0.0,
                  max_trials: int | None = None) -> ScheduleSpec:
    """A `ScheduleSpec` (not registered; name ``"<schedule>:tuned"``) whose lists for exactly
    these ``pp``, ``microbatches`` and ``virtual_stages`` fit ``costs`` (seconds per ``(kind,
    stage)``, kinds ``"F"``, ``"I"``, ``"W"``, every stage); see [Note: schedules tuned to
    measured costs]; ``max_trials``: the local search's budget of simulations (default
    `MAX_SWAP_TRIALS`; 0 keeps the best list scheduler's play). Raises ValueError for a schedule
    not in `TUNABLE_SCHEDULES` or missing costs."""
    base = get_schedule(schedule)
    if base.name not in TUNABLE_SCHEDULES:
        raise ValueError(f"pipeline: schedule {base.name!r} cannot be tuned; tune_schedule refits {TUNABLE_SCHEDULES}")
    v = virtual_stages
    base.check(pp, microbatches, v)
    S = pp * v
    missing = [f"{k}{s}" for s in range(S) for k in "FIW" if (k, s) not in costs]
    if missing:
        raise ValueError(f"pipeline: tune_schedule needs the time of every F, I and W of the {S} stages; missing "
                         f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} (run a step with the schedule "
                         "first: PipelineSchedule.last_action_times)")
    bad = [k for k, t in costs.items() if not t >= 0]
    if bad or not comm_time >= 0:
        raise ValueError(f"pipeline: tune_schedule costs and comm_time must be >= 0 seconds (bad: {bad or comm_time})")
    placement, cap = _caps(base.name, pp, microbatches, v)
    candidates = [base.actions(pp, microbatches, v)]
    for prefer in PREFERENCES:  # without and with reserve; a play that stalls under the cap is no candidate
        candidates += greedy_plays(pp, microbatches, v, placement, cap, costs=costs, comm_time=comm_time,
                                   prefer=prefer)
    spans = [simulate(c, S, microbatches, costs=costs, comm_time=comm_time)[0] for c in candidates]
    best = candidates[spans.index(min(spans))]
    budget = MAX_SWAP_TRIALS if max_trials is None else max_trials
    best, span = _swap_search(best, min(spans), cap, S, microbatches, costs, comm_time, budget)
    frozen: tuple[tuple[Action, ...], ...] = tuple(map(tuple, best))

    def build(rank: int, p: int, mb: int, vs: int) -> list[Action]:
        if (p, mb, vs) != (pp, microbatches, v):
            raise ValueError(f"pipeline: the tuned {base.name} lists are for pp={pp}, microbatches={microbatches}, "
                             f"virtual_stages={v}, not pp={p}, microbatches={mb}, virtual_stages={vs}; tune again")
        return list(frozen[rank])

    return replace(base, name=f"{base.name}:tuned", build=build, bubble=None,
                   summary=f"{base.name} fitted to measured action times (makespan {span:.4g} s simulated, "
                           f"{spans[0]:.4g} s for the registered list)")


MAX_SWAP_TRIALS = 2000
"""How many neighbouring lists `_swap_search` simulates at most (a count, not a time: every rank
must reach the same lists)."""


def _within_cap(acts: list[Action], cap: int) -> bool:
    alive = 0
    for a in acts:
        alive += 1 if a.kind is ActionKind.F else -1 if a.kind.frees_activations else 0
        if alive > cap:
            return False
    return True


def _swap_search(lists: list[list[Action]], span: float, cap: Callable[[int], int], S: int, m: int,
                 costs: Mapping[tuple[str, int], float], comm_time: float,
                 budget: int) -> tuple[list[list[Action]], float]:
    """Improve ``lists`` by swapping neighbouring actions of one rank while `simulate`'s makespan
    under ``costs`` falls (first improvement, passes over every rank and position, at most
    ``budget`` simulations). A swap that deadlocks, or puts a rank over its cap, is refused."""
    lists = [list(a) for a in lists]
    trials, improved = 0, True
    while improved and trials < budget:
        improved = False
        for r, acts in enumerate(lists):
            for i in range(len(acts) - 1):
                if trials >= budget:
                    break
                acts[i], acts[i + 1] = acts[i + 1], acts[i]
                ok = _within_cap(acts, cap(r))
                if ok:
                    trials += 1
                    try:
                        new = simulate(lists, S, m, costs=costs, comm_time=comm_time)[0]
                    except ValueError:  # a deadlock: this order waits on itself
                        ok = False
                    else:
                        ok = new < span * (1 - 1e-9)
                if ok:
                    span, improved = new, True
                else:
                    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    return lists, span
