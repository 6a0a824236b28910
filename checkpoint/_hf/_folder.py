"""Complete Hugging Face model folders: what ``save_pretrained`` writes, checked against the config.

Without ``config.json``, ``from_pretrained`` builds the class's default config and loads into it
(shape errors or random weights), so a folder holds the config, the weights (one file or
``model-0000i-of-0000n`` with an index) and optionally ``generation_config.json``. The check is
`HFConfig` ([Note: checking a folder before writing it] in ``_config.py``). `plan_folder` decides
which tensor goes into which file and `finish_folder` writes index and config, for `save_hf_folder`
(a live model, collective) and ``merge_checkpoint`` (from disk, also as ``tensors-*`` files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._base import CheckpointError, agree, broadcast_json, collective_device, is_distributed, rank_and_world
from .._format import StreamingWriter
from .._geometry import Box
from .._series import check_target, commit, remove_temp, temp_dir_for
from .._state import gather_full
from .._storage import PosixStorage
# CONFIG_FILE, HFConfig, read_config: also reached through this module, where they were first
from ._config import CONFIG_FILE, HFConfig, read_config, with_architecture, write_json  # noqa: F401
from ._moe import Part, expert_view, region
from ._safetensors import HF_INDEX_FILE, TENSORS_INDEX_FILE

__all__ = ["HFConfig", "read_config", "model_prefix", "plan_folder", "finish_folder", "save_hf_folder"]


def model_prefix(keys, prefix: str | None) -> str:
    """The prefix of a checkpoint's model tensors: ``prefix`` if given; else ``"model/"`` when
    keys start with it, ``""`` for a bare model state dict, and an error when there are only
    other groups (e.g. ``optim/``), so optimizer state never lands in the weights."""
    if prefix is not None:
        return prefix
    keys = list(keys)
    if any(k.startswith("model/") for k in keys):
        return "model/"
    groups = sorted({k.split("/", 1)[0] for k in keys if "/" in k})
    if groups:
        raise CheckpointError(f"the checkpoint has no 'model/' tensors, only the groups {groups}; pass the prefix "
                              "of the model's tensors (--prefix GROUP/), or --prefix '' for all of them")
    return ""


def group_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def shard_names(n: int, hf: bool) -> list[str]:
    """File names of ``n`` files: transformers' names for a folder with a config, otherwise
    ``tensors-...`` names that ``from_pretrained`` does not pick up."""
    if hf and n == 1:
        return ["model.safetensors"]
    stem = "model" if hf else "tensors"
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_folder(shapes: dict[str, tuple[int, ...]], itemsize: Callable[[str], int], max_shard_bytes: int,
                hf: HFConfig | None, same: Callable[[str, str], bool]) -> tuple[dict[str, Part], list[list[str]],
                                                                           list[str], int]:
    """``(parts by name, the names in each file, the file names, total bytes)`` of a folder of the
    tensors ``shapes`` (the state's names). With ``hf``: transformers' names, experts one by one
    ([Note: expert names in a Hugging Face folder]), the tensors ``hf.select`` keeps (``same(a,
    b)``: whether two of the state's tensors hold equal values); without: every tensor as it is,
    in ``tensors-*`` files. ``itemsize(name)``: the element size of the state's tensor."""
    if hf is not None:
        view = expert_view(hf.architecture, shapes)
        keys = hf.select(view.shapes, lambda a, b: same(view.source.get(a, a), view.source.get(b, b)))
        parts = {p.name: p for k in keys for p in view.parts[k]}
    else:
        parts = {n: Part(n, n, Box((0,) * len(s), s), s) for n, s in shapes.items()}
    sizes = {n: p.box.numel * itemsize(p.source) for n, p in parts.items()}
    shards = group_shards(sizes, max_shard_bytes)
    return parts, shards, shard_names(len(shards), hf is not None), sum(sizes.values())


def finish_folder(folder: str, names: list[str], shards: list[list[str]], total: int, hf: HFConfig | None) -> None:
    """Write the index next to the weight files ``names`` (none for a single ``model.safetensors``)
    and, with ``hf``, the config and its extra files."""
    index = (HF_INDEX_FILE if len(names) > 1 else None) if hf is not None else TENSORS_INDEX_FILE
    if index is not None:
        weight_map = {n: name for name, group in zip(names, shards) for n in group}
        write_json(os.path.join(folder, index),
                   json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    if hf is not None:
        hf.write(folder)


def save_hf_folder(model: nn.Module | dict, out: str | os.PathLike, *, config: Any = None,
                   max_shard_bytes: int = 5 << 30, extra_files: dict[str, bytes] | None = None,
                   replaceable: Callable[[Any, str], bool] | None = None,
                   own: Callable[[Any, str], set[str]] | None = None) -> list[str]:
    """Write ``model`` (sharded or not, or its state dict) as a complete ``save_pretrained``-style
    folder ``out``; collective. Returns the weight file names.

    ``config``: as `read_config` (default ``model.config``), checked first ([Note: checking a
    folder before writing it]). Tensors are gathered one at a time (`gather_full`) and written by
    rank 0; ``out`` appears complete or not at all. ``extra_files``: name -> bytes beside
    ``config.json``; ``replaceable`` / ``own``: as ``_series/_commit.commit``.
    """
    rank, _ = rank_and_world()
    state = model.state_dict() if isinstance(model, nn.Module) else model
    if config is None and isinstance(model, nn.Module):
        config = with_architecture(getattr(model, "config", None), model)
    target, where = os.path.abspath(os.fspath(out)), f"writing a Hugging Face folder to {os.fspath(out)}"
    plan, error, hf = None, None, None
    try:  # on every rank: `same` may gather (the same calls everywhere, the check being deterministic)
        if config is None:
            raise CheckpointError("save_hf_folder needs a config (config.json, its folder, a dict or a "
                                  "PretrainedConfig): without one from_pretrained builds a default model")
        if rank == 0:
            check_target(PosixStorage(), target, replaceable)
        hf = read_config(config)
        if extra_files:
            hf = dataclasses.replace(hf, extra={**hf.extra, **extra_files})
        shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        parts, shards, _, total = plan_folder(shapes, lambda k: state[k].element_size(), max_shard_bytes, hf,
                                              lambda a, b: _same(state[a], state[b]))
        plan = {"shards": shards, "total": total, "parts": {
            n: [p.source, list(p.box.offsets), list(p.box.sizes), list(p.shape)] for n, p in parts.items()}}
    except Exception as e:
        error = e
    agree(error, where)
    plan = broadcast_json(plan, src=0)
    shards, parts_of = plan["shards"], plan["parts"]
    names = shard_names(len(shards), True)
    gathered: dict[str, Any] = {}  # rank 0: the last few full sources (one MoE block's experts); None elsewhere
    tmp = token = None
    failed: BaseException | None = None  # rank 0's write error: it keeps joining the gathers, then all raise

    def on_rank0(step: Callable[[], Any]) -> Any:
        nonlocal failed
        if rank != 0 or failed is not None:
            return None
        try:
            return step()
        except Exception as e:
            failed = e
            return None

    if rank == 0:
        token = secrets.token_hex(4)
        tmp = temp_dir_for(PosixStorage(), target, token)
        on_rank0(lambda: os.makedirs(tmp))
    for name, group in zip(names, shards):
        entries = [(k, state[parts_of[k][0]].dtype, tuple(parts_of[k][3])) for k in group]
        writer = on_rank0(lambda: StreamingWriter(os.path.join(str(tmp), name), entries, {"format": "pt"}))
        for k in broadcast_json(writer.keys if writer is not None else list(group), src=0):
            src, offsets, sizes, _ = parts_of[k]
            if src not in gathered:
                if len(gathered) >= 4:
                    gathered.pop(next(iter(gathered)))
                gathered[src] = gather_full({src: state[src]}).get(src)  # collective; rank 0: full, on CPU
            if writer is not None and failed is None:
                on_rank0(lambda: writer.append(region(gathered[src], offsets, sizes).contiguous()))
        if writer is not None:
            if failed is None:
                on_rank0(writer.close)
            else:
                writer.abort()

    def finish() -> None:
        assert tmp is not None and token is not None and hf is not None
        finish_folder(tmp, names, shards, plan["total"], hf)
        commit(PosixStorage(), tmp, target, token, replaceable, own)

    on_rank0(finish)
    if failed is not None and tmp is not None:
        remove_temp(PosixStorage(), tmp)  # nothing half-written is left next to ``out``
    agree(failed, where)  # every rank raises rank 0's error, none waits
    return names


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values; collective when either is a DTensor (compares shards when laid out alike)."""
    with torch.no_grad():
        if isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements \
                and a.device_mesh == b.device_mesh and a.shape == b.shape:
            ok = torch.tensor([int(torch.equal(a.to_local(), b.to_local()))], device=collective_device())
            if is_distributed():
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            return bool(ok.item())
        fa = a.full_tensor() if isinstance(a, DTensor) else a
        fb = b.full_tensor() if isinstance(b, DTensor) else b
        return fa.shape == fb.shape and torch.equal(fa.cpu(), fb.cpu())
