"""Which rank holds which virtual stage (pure).

[Note: stage placement]
``pp * v`` stages on ``pp`` ranks. ``"loop"`` (GPipe, 1F1B, interleaved schedules): stage ``s``
on rank ``s % pp``, so rank ``r`` holds ``r, r + pp, ...`` and every chunk of ``pp`` stages runs
down the ranks. ``"v"`` (ZBV, DualPipeV): the chunks zig-zag, down the ranks then back up, so
with ``v = 2`` rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``: the first rank holds the first
and the last stage (the loss is computed where the input enters), and the middle hand-off
(stage ``pp - 1`` to ``pp``) stays on the last rank. A schedule states its placement
(``ScheduleSpec.placement``) and the split is made with the same (``pipeline_split(...,
placement=...)``).
"""

from __future__ import annotations

__all__ = ["PLACEMENTS", "check_placement", "stage_rank", "stages_of"]

PLACEMENTS = ("loop", "v")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"pipeline: placement={placement!r} is unknown; use one of {PLACEMENTS}")


def stage_rank(stage: int, pp: int, placement: str = "loop") -> int:
    """The rank on the ``pp`` axis that holds virtual stage ``stage``."""
    chunk, j = divmod(stage, pp)
    return j if placement == "loop" or chunk % 2 == 0 else pp - 1 - j


def stages_of(rank: int, pp: int, virtual_stages: int, placement: str = "loop") -> list[int]:
    """The virtual stages of ``rank``, in stage order."""
    return [s for s in range(pp * virtual_stages) if stage_rank(s, pp, placement) == rank]
