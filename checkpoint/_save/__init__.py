"""Saving: `save` / `async_save`, what each rank writes, where, and the handle of a save in flight.

| module | one line |
| --- | --- |
| `_save_plan.py` | which boxes each rank writes, their checksums, the index |
| `_save_target.py` | the folder a save goes to, checked on every rank |
| `_save_handle.py` | `SaveHandle`: a save running in the background |
| `_writer.py` | `save`, `async_save`, `check_save_target` |
"""

from ._writer import SaveHandle, async_save, check_save_target, save

__all__ = ["SaveHandle", "async_save", "check_save_target", "save"]
