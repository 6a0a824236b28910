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
"""

from ._cli import main
from ._dcp_import import ImportStats, import_dcp
from ._errors import CheckpointError
from ._hf import load_safetensors
from ._latest import latest_checkpoint
from ._loader import ElasticLoader
from ._sampler import BatchPlan, ElasticSampler, plan_batches
from ._hf_folder import save_hf_folder
from ._offline import merge_checkpoint, reshard_checkpoint
from ._reader import LoadStats, load
from ._save_pretrained import save_pretrained
from ._storage import FsspecStorage, PosixStorage, Storage
from ._state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from ._stateful import Stateful
from ._training_state import TrainingState, async_save_training_state, load_training_state, save_training_state
from ._verify import VerifyReport, verify_checkpoint
from ._writer import SaveHandle, async_save, check_save_target, save

__all__ = [
    "BatchPlan",
    "ElasticLoader",
    "ElasticSampler",
    "async_save_training_state",
    "latest_checkpoint",
    "plan_batches",
    "CheckpointError",
    "FsspecStorage",
    "ImportStats",
    "LoadStats",
    "SaveHandle",
    "StateDictOptions",
    "Stateful",
    "Storage",
    "TrainingState",
    "VerifyReport",
    "async_save",
    "check_save_target",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "import_dcp",
    "load",
    "load_training_state",
    "load_safetensors",
    "PosixStorage",
    "main",
    "merge_checkpoint",
    "reshard_checkpoint",
    "save",
    "save_hf_folder",
    "save_pretrained",
    "save_training_state",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "verify_checkpoint",
]
