"""``save_pretrained(model, dir)``: a Hugging Face model folder from a sharded transformers model.

transformers' ``model.save_pretrained(dir)`` fails on a sharded model (it finds ties by storage
pointer, and one unit's shards share a storage; torch's FSDP2 fails too). Two ways work, on
every rank: ``shardwise.checkpoint.save_pretrained(model, dir, max_shard_size="50GB")`` streams
one full tensor at a time (rank 0 writes) through `save_hf_folder`, with transformers' layout
and generation config, appearing complete or not at all and keeping other files of an earlier
flat folder (tokenizer, README); or ``model.save_pretrained(dir, state_dict=get_model_state_dict(
model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))`` on rank 0 (others
pass an empty dict; ``dist.barrier()`` before reading).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.nn as nn

from ._config import CONFIG_FILE
from ._folder import save_hf_folder
from ._safetensors import HF_INDEX_FILE

__all__ = ["save_pretrained", "parse_shard_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_MODEL_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def parse_shard_size(size: int | str) -> int:
    """transformers' ``max_shard_size``: bytes, or ``"5GB"`` (10^9), ``"5GiB"`` (2^30), ``"500MB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper()) if isinstance(size, str) else None
    if m is None or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB' or '500MiB', "
                         f"got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _model_files(storage: Any, path: str) -> set[str]:
    return {n for n in storage.list(path) if n in (CONFIG_FILE, "generation_config.json", HF_INDEX_FILE)
            or _MODEL_FILE.fullmatch(n)}


def _flat_folder(storage: Any, path: str) -> bool:
    return all(storage.kind(storage.join(path, n)) == "file" for n in storage.list(path))


def _generation_config(model: nn.Module) -> dict[str, bytes]:
    can = getattr(model, "can_generate", None)
    gen = getattr(model, "generation_config", None)
    if gen is None or not callable(can) or not can():
        return {}
    return {"generation_config.json": gen.to_json_string(use_diff=True).encode()}


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, max_shard_size: int | str = "50GB",
                    config: Any = None) -> list[str]:
    """Write ``model`` (a transformers model, sharded or not) as the folder transformers'
    ``save_pretrained`` writes, streamed one tensor at a time; collective (every rank calls
    it, rank 0 writes). Returns the weight file names. ``config`` defaults to ``model.config``
    (see the module docstring and `save_hf_folder`)."""
    return save_hf_folder(model, save_directory, config=config, max_shard_bytes=parse_shard_size(max_shard_size),
                          extra_files=_generation_config(model), replaceable=_flat_folder, own=_model_files)
