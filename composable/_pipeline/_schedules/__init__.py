"""Pipeline schedules, pure (no torch.distributed): action kinds, stage placement, the schedule
registry, `simulate`, the built-in schedules (one file each, registered on import in the order of
``SCHEDULES``), zero-bubble lists fitted to measured costs and the activations a rank holds.
The lowest room of ``_pipeline``."""

from . import _schedule_gpipe, _schedule_1f1b, _schedule_interleaved_1f1b, _schedule_zb_h1, _schedule_zbv, _schedule_dualpipev  # noqa: F401,E501  register, in this order
from ._actions import Action, ActionKind
from ._in_flight import InFlight, activations_in_flight, walk_in_flight
from ._placement import PLACEMENTS, check_placement, stage_rank
from ._registry import SCHEDULES, ScheduleSpec, get_schedule, register_schedule, unregister_schedule
from ._schedule_tuned import TUNABLE_SCHEDULES, tune_schedule
from ._simulate import build_schedule, simulate, theoretical_bubble

__all__ = ["Action", "ActionKind", "InFlight", "PLACEMENTS", "SCHEDULES", "ScheduleSpec", "TUNABLE_SCHEDULES",
           "activations_in_flight", "build_schedule", "check_placement", "get_schedule", "register_schedule",
           "simulate", "stage_rank", "theoretical_bubble", "tune_schedule", "unregister_schedule", "walk_in_flight"]
