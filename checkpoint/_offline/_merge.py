"""Offline tools (one process, no torch.distributed): merge to Hugging Face files, reshard.

Both verify the whole source first (``verify_checkpoint``; a box without a checksum is refused),
then copy one *slab* (dim-0 rows of one output box, at most ``chunk_bytes``) at a time through
``_copy.py`` (checksummed writes, a temporary directory committed as in [Note: atomic commit]
in ``_series/_commit.py``), and refuse an ``out`` that is, holds or lies in the source, or exists
(unless ``replace=True`` and it is an earlier output of the same kind; user files are kept).

* `merge_checkpoint` writes full tensors in files of at most ``max_shard_bytes``; ``prefix``
  (default ``"model/"``) selects and strips keys. With ``config`` a checked ``save_pretrained``
  folder (``_hf/_folder.py``); without, ``tensors-0000i-of-0000n.safetensors`` + an index that
  ``load_safetensors`` reads and ``from_pretrained`` does not mistake for a model.
* `reshard_checkpoint` lays every DTensor-saved tensor out as ``Shard(0)`` over ``world_size``
  ranks (FSDP's and HSDP's layout); plain and 0-d tensors go to rank 0.
"""

from __future__ import annotations

import os
import time

import torch
from torch.distributed.tensor import Shard

from .._base import CheckpointError, parse_json_strict
from .._format import (CheckpointFiles, FORMAT_NAME, INDEX_FILE, Index, SavedBox, TensorEntry, data_file_name,
                       format_index, index_to_json, plain_file_name)
from .._geometry import Box, LocalBox, boxes_for
from .._hf import HF_INDEX_FILE, TENSORS_INDEX_FILE, finish_folder, model_prefix, plan_folder, read_config
from .._storage import PosixStorage, Storage
from ._copy import (Progress as _Progress, Source as _Source, into_place as _into_place, verified as _verified,
                    write_file as _write)

__all__ = ["merge_checkpoint", "reshard_checkpoint"]


_MERGE_MARKS = (HF_INDEX_FILE, TENSORS_INDEX_FILE, "model.safetensors")  # one of them is in every merge output


def _is_hf_export(storage: Storage, path: str) -> bool:
    return any(storage.kind(storage.join(path, m)) == "file" for m in _MERGE_MARKS)


def _hf_own_files(storage: Storage, path: str) -> set[str]:
    """What a merge wrote into ``path``: its index file and the files of its weight map."""
    names = set(_MERGE_MARKS) | {HF_INDEX_FILE + ".tmp", TENSORS_INDEX_FILE + ".tmp"}
    for index_file in (HF_INDEX_FILE, TENSORS_INDEX_FILE):
        try:
            data = storage.read_small(storage.join(path, index_file), 64 << 20)
            weight_map = parse_json_strict(data.decode("utf-8")).get("weight_map", {})
            names |= {n for n in weight_map.values() if plain_file_name(n)}
        except (OSError, ValueError, AttributeError, RecursionError, CheckpointError):
            pass
    return names


def merge_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, prefix: str | None = None,
                     config=None, max_shard_bytes: int = 5 << 30, chunk_bytes: int = 64 << 20,
                     progress: bool = False, replace: bool = False) -> list[str]:
    """Write the full tensors of the checkpoint at ``path`` into the new folder ``out`` (module
    docstring); returns the file names. ``prefix`` None: the ``model/`` tensors. With ``config``
    a checked ``save_pretrained`` folder; without, ``tensors-*`` files. Raises `CheckpointError`
    before writing anything; ``replace=True`` replaces an earlier merge output."""
    with _verified(path) as files:
        return _merge(files, out, prefix, config, max_shard_bytes, chunk_bytes, progress, replace)


def _merge(files: CheckpointFiles, out: str | os.PathLike, prefix: str | None, config: object, max_shard_bytes: int,
           chunk_bytes: int, progress: bool, replace: bool) -> list[str]:
    index = files.index
    prefix = model_prefix(index.tensors, prefix)
    keys = [k for k in index.tensors if k.startswith(prefix) and k not in index.blobs]  # bytes values stay out
    if not keys:
        raise CheckpointError(f"checkpoint {files.where} has no tensor whose key starts with {prefix!r}")
    hf = read_config(config) if config is not None else None
    shapes = {k[len(prefix):]: tuple(index.tensors[k].shape) for k in keys}
    source = _Source(files)

    def same(a: str, b: str) -> bool:
        return torch.equal(*(source.read(prefix + n, Box((0,) * len(shapes[n]), shapes[n])) for n in (a, b)))

    parts, shards, names, total = plan_folder(shapes, lambda n: index.tensors[prefix + n].dtype.itemsize,
                                              max_shard_bytes, hf, same)
    bar = _Progress("merge", total, progress)

    def fill(tmp: str) -> None:
        for name, group in zip(names, shards):
            entries = [(n, prefix + parts[n].source, parts[n].box, parts[n].shape) for n in group]
            _write(os.path.join(tmp, name), source, entries, chunk_bytes, bar, {"format": "pt"})
        finish_folder(tmp, names, shards, total, hf)

    _into_place(files.where, os.fspath(out), fill, replace, _is_hf_export, _hf_own_files,
                f"a merge output (a folder with {HF_INDEX_FILE}, {TENSORS_INDEX_FILE} or model.safetensors)")
    return names


def reshard_checkpoint(path: str | os.PathLike, out: str | os.PathLike, world_size: int, *,
                       chunk_bytes: int = 64 << 20, progress: bool = False, replace: bool = False) -> None:
    """Rewrite the checkpoint at ``path`` into ``out`` laid out for ``world_size`` ranks (module
    docstring); plain values kept, a per-rank one with its rank; source and ``out`` rules as
    `merge_checkpoint`'s."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    with _verified(path) as files:
        _reshard(files, out, world_size, chunk_bytes, progress, replace)


def _reshard(files: CheckpointFiles, out: str | os.PathLike, world_size: int, chunk_bytes: int, progress: bool,
             replace: bool) -> None:
    index = files.index
    per_rank: list[list[tuple[str, str, Box]]] = [[] for _ in range(world_size)]
    layouts = {}
    for key, t in index.tensors.items():
        sharded = t.layout is not None and len(t.shape) > 0
        layouts[key] = {"mesh_shape": [world_size], "mesh_dim_names": None,
                        "placements": [repr(Shard(0))]} if sharded else None
        for r in range(world_size) if sharded else [0]:
            lbs = boxes_for(t.shape, (world_size,), (r,), [Shard(0)]) if sharded else (
                [LocalBox(Box((0,) * len(t.shape), t.shape), ())] if 0 not in t.shape else [])
            per_rank[r] += [(f"{key}@{','.join(map(str, lb.box.offsets))}", key, lb.box) for lb in lbs]
    bar = _Progress("reshard", sum(t.nbytes for t in index.tensors.values()), progress)

    def fill(tmp: str) -> None:
        source = _Source(files)
        boxes: dict[str, list[SavedBox]] = {k: [] for k in index.tensors}
        sizes: dict[str, int | None] = {}
        for r, parts in enumerate(per_rank):
            if not parts:
                continue
            name = data_file_name(r)
            sums = _write(os.path.join(tmp, name), source, parts, chunk_bytes, bar,
                          {"format": FORMAT_NAME, "rank": str(r)})
            sizes[name] = os.path.getsize(os.path.join(tmp, name))
            for fk, key, box in parts:
                s = sums[fk]
                boxes[key].append(SavedBox(box, name, fk, s.crc32, s.chunk_rows, s.chunk_crc32))
        tensors = {k: TensorEntry(t.dtype, t.shape, tuple(boxes[k]), layouts[k]) for k, t in index.tensors.items()}
        new = Index(tensors, index.values, sizes, world_size, time.time_ns(),
                    save_id=os.path.basename(tmp).rsplit("-", 1)[-1], blobs=index.blobs)
        PosixStorage().write_atomic(os.path.join(tmp, INDEX_FILE), format_index(index_to_json(new)).encode())

    _into_place(files.where, os.fspath(out), fill, replace)
