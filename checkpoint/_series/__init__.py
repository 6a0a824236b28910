"""Checkpoints in place: the atomic commit of a save's folder, the series record, the latest one."""

from ._commit import (check_target, commit, delete_own_files, intact_replaced, interrupted_save, is_checkpoint,
                      own_files, remove_temp, stand_in, temp_dir_for)
from ._latest import latest_checkpoint
from ._series import abort_save, begin_save, default_series, finish_save

__all__ = ["abort_save", "begin_save", "check_target", "commit", "default_series", "delete_own_files", "finish_save",
           "intact_replaced", "interrupted_save", "is_checkpoint", "latest_checkpoint", "own_files", "remove_temp",
           "stand_in", "temp_dir_for"]
