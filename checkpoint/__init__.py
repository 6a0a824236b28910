"""shardwise.checkpoint: reshardable safetensors checkpoints.

Save from any layout, load into any other::

    from shardwise.checkpoint import save, load, get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    save(state, "ckpt/step-100", keep_last=3)      # collective; atomic
    ...
    load(state, "ckpt/step-100")                    # fills the tensors in place, resharding
    set_optimizer_state_dict(model, optim, state["optim"])

``path`` may be an fsspec URL (``s3://bucket/ckpt/step-100``, ``memory://...``), or pass
``storage=`` (`PosixStorage`, `FsspecStorage`, or any class implementing `Storage`).

See ``docs/checkpoint.md`` (usage and API) and ``docs/checkpoint-format.md`` (the format).

The package is in rooms (subpackages), listed lowest first in `ROOMS`: a room imports only
rooms listed before it, and another room only through that room's ``__init__``
(``tests/test_checkpoint_modules.py`` checks both). Its top holds only this file, ``_cli.py``
and ``__main__.py``.
"""

import warnings as _warnings

from ._base import CheckpointError
from ._cli import main
from ._dcp_import import ImportStats, import_dcp
from ._elastic import (BatchPlan, ElasticLoader, ElasticSampler, Heartbeat, HeartbeatPolicy, TrainingSnapshot,
                       async_save_training_state, exit_for_restart, load_training_state, plan_batches,
                       save_training_state, start_heartbeat)
from ._hf import load_safetensors, save_hf_folder, save_pretrained
from ._load import LoadStats, load
from ._offline import VerifyReport, merge_checkpoint, reshard_checkpoint, verify_checkpoint
from ._save import SaveHandle, async_save, check_save_target, save
from ._series import latest_checkpoint
from ._state import (DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter, StateDictOptions, Stateful, gather_full,
                     get_model_state_dict, get_optimizer_state_dict, get_state_dict, scatter_full, set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from ._storage import FsspecStorage, PosixStorage, Storage

ROOMS = ("_base", "_storage", "_geometry", "_format", "_state", "_series", "_save", "_load", "_hf", "_offline",
         "_dcp_import", "_elastic")
"""The rooms of the package, lowest first: each imports only rooms before it (tests read this)."""

__all__ = ["BatchPlan", "CheckpointError", "DefaultLoadPlanner", "DefaultSavePlanner", "ElasticLoader", "ElasticSampler", "FileSystemReader", "FileSystemWriter",
           "FsspecStorage", "Heartbeat",
           "HeartbeatPolicy", "ImportStats", "LoadStats", "PosixStorage", "SaveHandle", "StateDictOptions", "Stateful",
           "Storage", "TrainingSnapshot", "VerifyReport", "async_save", "async_save_training_state",
           "check_save_target", "exit_for_restart", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "import_dcp", "latest_checkpoint", "load", "load_safetensors", "load_training_state",
           "main", "merge_checkpoint", "plan_batches", "reshard_checkpoint", "save", "save_hf_folder",
           "save_pretrained", "save_training_state", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict", "start_heartbeat", "verify_checkpoint"]


def __getattr__(name: str):
    """``TrainingState``, the old name of `TrainingSnapshot` (deprecated; it clashed with the
    unrelated enum of the same name in ``composable/_fsdp``)."""
    if name != "TrainingState":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn("shardwise.checkpoint.TrainingState is now shardwise.checkpoint.TrainingSnapshot",
                   DeprecationWarning, stacklevel=2)
    return TrainingSnapshot
