"""Training-state checkpoints: what Accelerate's ``save_state`` / ``load_state`` keep, resharded.

    save_training_state("ckpt/step-100", model, optim, scheduler=sched, step=100, extra={"epoch": 3})
    ts = load_training_state("ckpt/step-100", model, optim, scheduler=sched)   # any world size

One ordinary checkpoint (`save` / `load`: atomic, verified, reshardable) holding ``{"model",
"optim", "scheduler", "step", "extra", "rng"}``: model and optimizer by parameter name, the
scheduler's ``state_dict()`` and ``extra`` as JSON text, every rank's random states.

[Note: random states per rank]
Each rank draws its own random numbers, so ``rng/torch`` is a ``[W, n]`` uint8 tensor whose row
``r`` is rank ``r``'s ``torch.get_rng_state()``; likewise ``rng/cuda``, ``rng/python`` (plus
``rng/python_gauss``) and, if numpy was imported, ``rng/numpy``. On load at the same world size
rank ``r`` gets row ``r`` (training continues exactly); at another size with all rows equal every
rank gets that state; with rows that differ rank ``r`` gets row ``r mod W`` (reseed if they must
differ). `TrainingSnapshot.rng` says which happened (``"per-rank"``, ``"shared"``,
``"wrapped"``).

``data=`` (an `ElasticSampler` / `ElasticLoader`, or anything with a JSON ``state_dict()``) is
saved as the plain value ``data``, checked equal on every rank, loadable at any data-parallel
size ([Note: one global order, cut into global batches] in ``_sampler.py``).
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._base import CheckpointError, all_gather_json, collective_device, is_distributed, rank_and_world
from .._format import open_checkpoint
from .._load import load
from .._state import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict
from .._save import SaveHandle, async_save, save

__all__ = ["TrainingSnapshot", "save_training_state", "async_save_training_state", "load_training_state"]


@dataclass(frozen=True)
class TrainingSnapshot:
    """What `load_training_state` restored besides tensors: ``step``, ``extra``, the saving world
    size and how each generator was restored ([Note: random states per rank])."""

    step: int | None
    extra: Any
    saved_world_size: int
    rng: dict
    data: Any = None  # the saved data position (``data=`` of the save), None if none was saved


def _gather_rows(row: torch.Tensor) -> torch.Tensor:
    """``[W, n]``: every rank's ``row`` (all rows the same length), on every rank."""
    if not is_distributed():
        return row.unsqueeze(0).clone()
    dev = collective_device()
    parts = [torch.empty_like(row, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, row.to(dev))
    return torch.stack(parts).cpu()


def _rng_rows() -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()
    rows = {"torch": torch.get_rng_state(),
            "python": torch.tensor([version, *words], dtype=torch.int64),
            "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rows["cuda"] = torch.cuda.get_rng_state()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        rows["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64)
        rows["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return rows


def _gathered_rng() -> dict[str, torch.Tensor]:
    """``{kind: [W, n]}`` of the generators every rank has (numpy only if all imported it)."""
    rows = _rng_rows()
    common = set(rows)
    for kinds in all_gather_json(sorted(rows)) if is_distributed() else []:
        common &= set(kinds)
    return {k: _gather_rows(rows[k]) for k in sorted(common)}


def _numpy_for(path) -> Any:
    """numpy, to restore the saved ``rng/numpy`` row; a clear error where it is not installed."""
    try:
        import numpy as np  # saved by a job that used it; restored only where it is installed
    except ImportError:
        raise CheckpointError(
            f"{path} holds numpy's random state (rng/numpy, saved by a job that had imported numpy), but numpy "
            "cannot be imported here; install numpy, or pass rng=False to load_training_state to leave the "
            "random states alone") from None
    return np


def _set_rng(rows: dict[str, torch.Tensor], path) -> None:
    np = _numpy_for(path) if "numpy" in rows else None  # before any generator is touched
    torch.set_rng_state(rows["torch"].clone())
    words = rows["python"].tolist()
    has_gauss, gauss = rows["python_gauss"].tolist()
    random.setstate((int(words[0]), tuple(int(w) for w in words[1:]), gauss if has_gauss else None))
    if "cuda" in rows and torch.cuda.is_available():
        torch.cuda.set_rng_state(rows["cuda"].clone())
    if np is not None:
        keys = rows["numpy"].tolist()
        np.random.set_state(("MT19937", np.array(keys[:-2], dtype=np.uint32), int(keys[-2]), int(keys[-1]),
                             float(rows["numpy_gauss"][0])))


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_training_state: {what} must be JSON-serialisable ({e}); keep tensors in the "
                              "model or optimizer, or convert them with .tolist()") from None


def _data_state(data: Any) -> str:
    """The data position as JSON text, checked to be the same on every rank."""
    text = _json(data.state_dict() if data is not None else None, "data.state_dict()")
    if is_distributed():
        texts = all_gather_json(text)
        differ = [r for r, t in enumerate(texts) if t != texts[0]]
        if differ:
            raise CheckpointError(f"save_training_state: the data position (data=) of ranks {differ} differs from "
                                  f"rank 0's ({texts[0]}); every rank must step its sampler alike")
    return text


def _state(model: nn.Module, optim: torch.optim.Optimizer, scheduler: Any, step: int | None, extra: Any,
           data: Any) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "scheduler": _json(scheduler.state_dict() if scheduler is not None else None, "the scheduler's state_dict()"),
        "step": step,
        "extra": _json(extra, "extra"),
        "data": _data_state(data),
        "rng": _gathered_rng(),
    }


def save_training_state(path: str | os.PathLike, model: nn.Module, optim: torch.optim.Optimizer, *,
                        scheduler: Any = None, step: int | None = None, extra: Any = None,
                        data: Any = None, keep_last: int | None = None) -> None:
    """Save model, optimizer, LR ``scheduler`` (anything with ``state_dict()``), ``step``,
    ``extra`` (JSON), the data position ``data`` (an `ElasticSampler` / `ElasticLoader`) and
    every rank's RNG states to ``path``; collective, atomic (see `save`). ``keep_last`` as in
    `save`."""
    save(_state(model, optim, scheduler, step, extra, data), path, keep_last=keep_last)


def async_save_training_state(path: str | os.PathLike, model: nn.Module, optim: torch.optim.Optimizer, *,
                              scheduler: Any = None, step: int | None = None, extra: Any = None,
                              data: Any = None, keep_last: int | None = None) -> SaveHandle:
    """`save_training_state` with `async_save`: returns once the state is copied to CPU memory
    (the RNG states and data position are taken now); ``handle.wait()`` (collective) commits it.
    Training may change the model and optimizer meanwhile."""
    return async_save(_state(model, optim, scheduler, step, extra, data), path, keep_last=keep_last)


def load_training_state(path: str | os.PathLike, model: nn.Module, optim: torch.optim.Optimizer, *,
                        scheduler: Any = None, rng: bool = True, data: Any = None) -> TrainingSnapshot:
    """Restore what `save_training_state` saved into ``model``, ``optim``, ``scheduler`` and
    ``data`` (the sampler or loader, which resumes the saved position at this data-parallel
    size), at this or another world size and layout; collective. ``rng=False`` leaves the random
    states alone. Returns the step, extra, data position and how the RNG states were restored."""
    with open_checkpoint(path) as files:
        index = files.index
    rng_keys = sorted(k[4:] for k in index.tensors if k.startswith("rng/"))
    if "torch" not in rng_keys or "step" not in index.values:
        raise CheckpointError(f"{path} is a checkpoint but not a training state (no rng/torch or step); load it "
                              "with shardwise.checkpoint.load")
    saved_world = index.tensors["rng/torch"].shape[0]
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "scheduler": "", "step": None, "extra": "", **({"data": ""} if "data" in index.values else {}),
        "rng": {k: torch.empty(index.tensors[f"rng/{k}"].shape, dtype=index.tensors[f"rng/{k}"].dtype)
                for k in rng_keys},
    }
    load(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    sched = json.loads(state["scheduler"])
    if scheduler is not None:
        if sched is None:
            raise CheckpointError(f"{path} holds no scheduler state, but a scheduler was passed")
        scheduler.load_state_dict(sched)
    saved_data = json.loads(state["data"]) if "data" in state else None
    if data is not None:
        if saved_data is None:
            raise CheckpointError(f"{path} holds no data position (saved without data=), but data= was passed; "
                                  "start the data from its beginning instead")
        try:
            data.load_state_dict(saved_data)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    rank, world = rank_and_world()
    rows, how = state["rng"], {}
    pick: dict[str, int] = {}
    for gen in sorted({k.split("_")[0] for k in rows}):  # python + python_gauss are one generator
        mine = [t for k, t in rows.items() if k.split("_")[0] == gen]
        if world == saved_world:
            how[gen], pick[gen] = "per-rank", rank
        elif all(torch.equal(t[0], t[i]) for t in mine for i in range(1, saved_world)):
            how[gen], pick[gen] = "shared", 0
        else:
            how[gen], pick[gen] = "wrapped", rank % saved_world
    if rng:
        _set_rng({k: t[pick[k.split("_")[0]]] for k, t in rows.items()}, path)
    return TrainingSnapshot(state["step"], json.loads(state["extra"]), saved_world, how if rng else {}, saved_data)
