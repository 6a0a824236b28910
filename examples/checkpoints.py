"""What ``examples/train.py`` saves and how it resumes: the state a checkpoint holds (model and
optimizer keyed by parameter name, so it reshards like the parameters; the step; the
arguments that fix the model's shapes), loading it into a built model, and saving with a
fallback folder so that a failed save after training does not lose the weights.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise.checkpoint as ckpt

__all__ = ["app_state", "resume", "dir_bytes", "save_or_rescue"]


def app_state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, model_args: dict | None = None) -> dict:
    """What a checkpoint holds: the model and optimizer state keyed by parameter name (so it
    reshards like the parameters), the step and the arguments that fix the model's shapes
    (``MODEL_ARGS``, checked before a resume builds anything)."""
    return {"model": ckpt.get_model_state_dict(model), "optim": ckpt.get_optimizer_state_dict(model, optim),
            "trainer": {"step": step, "model_args": dict(model_args or {})}}


def resume(model: torch.nn.Module, optim: torch.optim.Optimizer, path: str) -> tuple[int, int]:
    """Load ``path`` into ``model`` and ``optim`` (resharding to this job's layout); return the
    step it was saved at and the bytes this rank read."""
    state = app_state(model, optim, 0)
    stats = ckpt.load(state, path)
    ckpt.set_model_state_dict(model, state["model"])
    ckpt.set_optimizer_state_dict(model, optim, state["optim"])
    return int(state["trainer"]["step"]), stats.bytes_read


def dir_bytes(path: str) -> int:
    """Bytes of the files in ``path`` (a checkpoint folder; a local path or an fsspec URL)."""
    if "://" in path:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path)
        return sum(int(e["size"]) for e in fs.ls(root, detail=True) if e["type"] == "file")
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def save_or_rescue(state: dict, path: str, say) -> str:
    """Save ``state`` to ``path``; if that fails after training (the disk filled up, the folder
    went away), save it to a fresh folder under the system's temporary directory instead and say
    so, so that the trained weights are not lost. Returns where it was saved; collective."""
    try:
        ckpt.save(state, path)
        return path
    except ckpt.CheckpointError as e:
        first = str(e).splitlines()[0]
    where = [os.path.join(tempfile.gettempdir(), f"shardwise-rescue-{time.strftime('%Y%m%d-%H%M%S')}-"
                          f"{os.getpid()}", Path(path).name or "checkpoint")]
    dist.broadcast_object_list(where)  # one folder for every rank (rank 0's name)
    say(f"could not save to {path} ({first}); saving to {where[0]} instead", flush=True)
    try:
        ckpt.save(state, where[0])
    except ckpt.CheckpointError as e2:
        say(f"the trained weights are lost: saving to {where[0]} failed too "
            f"({str(e2).splitlines()[0]})", flush=True)
        raise
    return where[0]
