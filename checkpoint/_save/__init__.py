"""Saving: `save` / `async_save`, what each rank writes, where, and the handle of a save in flight."""

from ._writer import SaveHandle, async_save, check_save_target, save

__all__ = ["SaveHandle", "async_save", "check_save_target", "save"]
