"""Checkpoints in place: the atomic commit of a save's folder, the series record, the latest one.

| module | one line |
| --- | --- |
| `_commit.py` | temporary folder, durable rename into place, what may be replaced ([Note: atomic commit]) |
| `_series.py` | the series record: saves begun, finished, aborted; ``keep_last`` |
| `_latest.py` | `latest_checkpoint`: the newest complete checkpoint of a series |
"""

from ._commit import (check_target, commit, delete_own_files, intact_replaced, is_checkpoint, own_files, remove_temp,
                      temp_dir_for)
from ._latest import latest_checkpoint
from ._series import abort_save, begin_save, default_series, finish_save

__all__ = ["abort_save", "begin_save", "check_target", "commit", "default_series", "delete_own_files", "finish_save",
           "intact_replaced", "is_checkpoint", "latest_checkpoint", "own_files", "remove_temp", "temp_dir_for"]
