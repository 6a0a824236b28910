"""The schedule registry: a schedule is one `ScheduleSpec`, looked up by name (pure).

A spec builds the action list of one rank from ``(rank, pp, microbatches, virtual_stages)``
and states what it accepts (virtual stages, a microbatch count that is a multiple of ``pp``)
and, optionally, its theoretical bubble. `build_schedule`, `simulate`, `theoretical_bubble`,
`PipelineSchedule` and the memory planner (`activations_in_flight`) all work from the spec, so
a new schedule is one file that calls `register_schedule` (docs/pipeline.md shows one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from ._actions import Action, ActionKind
from ._placement import check_placement, stage_rank

__all__ = ["SCHEDULES", "ScheduleSpec", "get_schedule", "one_f_one_b_bubble", "register_schedule",
           "unregister_schedule"]

BuildFn = Callable[[int, int, int, int], list[Action]]
BubbleFn = Callable[[int, int, int], float]


def one_f_one_b_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """``(p - 1) / (v m + p - 1)``: idle fraction of a rank (backward twice the forward); also
    GPipe's and interleaved 1F1B's."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    Fields:
        name: what ``PipelineSchedule(schedule=...)`` and ``build_schedule`` take.
        build: ``build(rank, pp, microbatches, virtual_stages) -> list[Action]``: the actions of
            rank ``rank`` in the order it runs them; rank ``r`` holds virtual stages ``r``,
            ``r + pp``, ... ([Note: schedules] in ``_simulate.py``), or as ``placement`` says.
        virtual: True if it runs ``virtual_stages >= 1`` stages per rank; False: exactly one
            (``virtual_stages != 1`` is refused).
        microbatch_multiple_of_pp: refuse a microbatch count that ``pp`` does not divide.
        bubble: ``bubble(pp, microbatches, virtual_stages)``, the idle fraction of a rank with
            forward time 1 and backward time 2 (what `simulate` should find); None: unknown.
        summary: one line for docs and errors.
        placement: ``"loop"`` (stage ``s`` on rank ``s % pp``) or ``"v"`` (down the ranks and
            back up: [Note: stage placement] in ``_placement.py``); the split must use the same.
        exact_virtual_stages: the one number of stages per rank it runs (ZBV: 2), or None.
        min_microbatches_per_stage: refuse fewer microbatches than stages (``pp * v``; DualPipeV).
    """

    name: str
    build: BuildFn
    virtual: bool = False
    microbatch_multiple_of_pp: bool = False
    bubble: BubbleFn | None = None
    summary: str = ""
    placement: str = "loop"
    exact_virtual_stages: int | None = None
    min_microbatches_per_stage: bool = False

    def check(self, pp: int, microbatches: int, virtual_stages: int) -> None:
        """``ValueError`` naming the argument and the fix if the spec cannot run these sizes."""
        m, v = microbatches, virtual_stages
        if pp < 1 or v < 1:
            raise ValueError(f"pipeline: pp={pp} and virtual stages v={v} must be >= 1")
        if m < 1:
            raise ValueError(f"pipeline: microbatches={m}; it must be >= 1")
        if self.microbatch_multiple_of_pp and m % pp:
            raise ValueError(f"pipeline: {self.name} needs microbatches ({m}) to be a multiple of pp ({pp}); "
                             f"use {-(-m // pp) * pp} microbatches, or schedule='1f1b'")
        check_placement(self.placement)
        if self.exact_virtual_stages is not None and v != self.exact_virtual_stages:
            raise ValueError(f"pipeline: schedule={self.name!r} runs exactly {self.exact_virtual_stages} stages per "
                             f"rank but {v} virtual stages were requested; use virtual_stages="
                             f"{self.exact_virtual_stages}")
        if self.min_microbatches_per_stage and m < pp * v:
            raise ValueError(f"pipeline: {self.name} needs at least as many microbatches as stages ({pp} x {v} = "
                             f"{pp * v}); got microbatches={m}; use {pp * v} or more")
        if not self.virtual and v != 1:
            virtual = [s.name for s in _REGISTRY.values() if s.virtual]
            raise ValueError(f"pipeline: schedule={self.name!r} runs one stage per rank but {v} virtual stages were "
                             f"requested; use a schedule with virtual stages ({', '.join(virtual)}) or "
                             "virtual_stages=1")

    def actions(self, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
        """The checked action list of every rank (index = rank on the ``pp`` axis); ``ValueError``
        if a pair (``FB``) holds a half of a stage its rank does not hold."""
        self.check(pp, microbatches, virtual_stages)
        out = [list(self.build(r, pp, microbatches, virtual_stages)) for r in range(pp)]
        for r, acts in enumerate(out):
            for a in acts:
                if a.kind is ActionKind.FB and any(stage_rank(h.stage, pp, self.placement) != r for h in a.halves):
                    raise ValueError(f"pipeline: schedule {self.name!r} pairs {a!r} on pp rank {r}, which does not "
                                     f"hold both stages (placement {self.placement!r}); pair two actions of one rank")
        return out


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add ``spec`` under ``spec.name`` (``ValueError`` if the name is taken, unless ``replace``);
    returns it. Register on every rank, before building a ``PipelineSchedule`` that names it."""
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule: expected a ScheduleSpec, got {type(spec).__name__}")
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError(f"register_schedule: a schedule needs a non-empty name, got {spec.name!r}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"register_schedule: a schedule named {spec.name!r} is already registered; pick another "
                         "name, or pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_schedule(name: str) -> None:
    """Remove a registered schedule (a no-op for an unknown name)."""
    _REGISTRY.pop(name, None)


def get_schedule(name: str | ScheduleSpec) -> ScheduleSpec:
    """The spec registered as ``name`` (a spec is returned as is); ``ValueError`` naming the
    registered ones otherwise."""
    if isinstance(name, ScheduleSpec):
        return name
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"pipeline: schedule={name!r} is unknown; choose one of {tuple(_REGISTRY)} "
                         "(or register_schedule a ScheduleSpec of your own)")
    return spec


class _Names(Sequence[str]):
    """The registered schedule names, in registration order; a live view of the registry."""

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        return tuple(_REGISTRY)[i]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _Names)) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))


SCHEDULES: Sequence[str] = _Names()
"""The names of the registered schedules (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``,
``"zbv"``, ``"interleaved_zb"``, ``"dualpipev"``, and any registered since)."""
