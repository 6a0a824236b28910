"""The built-in schedules, one file each; importing this package registers them.

A built-in schedule is one module here defining its `ScheduleSpec` and registering it, plus its
import line below (the order below is the order of ``SCHEDULES``).
"""

from . import _gpipe, _1f1b, _interleaved_1f1b  # noqa: F401  (each registers its spec)

__all__: list[str] = []
