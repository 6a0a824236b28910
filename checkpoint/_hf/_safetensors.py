"""Hugging Face style safetensors: load them into (sharded) state without holding them whole.

`hf_index` describes ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` with its
``weight_map`` index) as an `Index` whose boxes are whole tensors (no checksums), so the ordinary
load path applies: each rank reads only the slices its shards need.

[Note: tied weights]
``save_pretrained`` writes a tensor shared by two names once (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``). `load_safetensors` groups the target's tensors that are one tensor
(same object, or views of one storage with the same offset, shape and strides; a DTensor's local
shard) and counts a name missing from the files as loaded when a partner is there. Only in dicts;
a tensor in a list is never treated as tied.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from .._base import CheckpointError, agree
from .._format import CheckpointFiles, DTYPE_CODES, Index, SavedBox, TensorEntry, open_folder, read_header
from .._state import flatten, join_key
from .._geometry import Box
from .._load import LoadStats, load_from_index
from .._storage import PosixStorage

__all__ = ["HF_INDEX_FILE", "TENSORS_INDEX_FILE", "hf_files", "load_safetensors", "tied_groups"]

HF_INDEX_FILE = "model.safetensors.index.json"
TENSORS_INDEX_FILE = "tensors.safetensors.index.json"  # merge without a config: not a transformers name
_FROM_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def _files(source: str) -> tuple[str, list[str]]:
    if os.path.isfile(source):
        return os.path.dirname(source), [os.path.basename(source)]
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} does not exist")
    index_file = next((f for f in (os.path.join(source, n) for n in (HF_INDEX_FILE, TENSORS_INDEX_FILE))
                       if os.path.isfile(f)), "")
    if index_file:
        try:
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file} is not a valid safetensors index ({type(e).__name__}: {e})") from None
        return source, sorted(set(weight_map.values()))
    names = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{source} holds no .safetensors file")
    return source, names


def hf_files(source: str | os.PathLike, prefix: str = "") -> CheckpointFiles:
    """The files of a safetensors file or Hugging Face folder, with an `Index` of their tensors,
    each tensor's flat key being ``prefix + name`` (files may be symbolic links: a download
    cache). The caller closes it."""
    root, names = _files(os.path.abspath(os.fspath(source)))
    storage = PosixStorage()
    tensors: dict[str, TensorEntry] = {}
    for name in names:
        h = storage.open_read(os.path.join(root, name), follow=True)
        try:
            header = read_header(h)
        finally:
            h.close()
        for key, e in header.entries.items():
            if e.dtype not in _FROM_CODE:
                raise CheckpointError(f"{os.path.join(root, name)}: tensor '{key}' has dtype {e.dtype}, unknown here")
            if prefix + key in tensors:
                raise CheckpointError(f"tensor '{key}' appears in {name} and in {tensors[prefix + key].boxes[0].file}")
            box = SavedBox(Box((0,) * len(e.shape), e.shape), name, key, None)
            tensors[prefix + key] = TensorEntry(_FROM_CODE[e.dtype], e.shape, (box,) if 0 not in e.shape else ())
    return open_folder(storage, root, Index(tensors))


def _storage_key(t: torch.Tensor):
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device.type == "meta" or local.numel() == 0:
        return None
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)


def tied_groups(state: dict) -> list[list[str]]:
    """Flat keys of ``state``'s tensors that are one tensor, in groups of two or more, each in
    tree order (see [Note: tied weights])."""
    groups: dict[object, list[str]] = {}
    by_id: dict[int, object] = {}
    for leaf in flatten(state):
        t = leaf.value
        if not isinstance(t, torch.Tensor) or not isinstance(leaf.parent, dict):
            continue
        key = by_id.get(id(t)) or _storage_key(t) or ("id", id(t))
        by_id[id(t)] = key
        groups.setdefault(key, []).append(leaf.key)
    return [g for g in groups.values() if len(g) > 1]


def _without(state: dict, drop: set[str], path: tuple = ()) -> dict:
    """``state`` (shallow copies of its dicts) without the tensor leaves whose flat key is in ``drop``."""
    out = {}
    for name, value in state.items():
        key = join_key((*path, name))
        if key in drop:
            continue
        inside = isinstance(value, dict) and any(d.startswith(key + "/") for d in drop)
        out[name] = _without(value, drop, (*path, name)) if inside else value
    return out


def _tied_missing(state: dict, index: Index) -> Iterator[str]:
    """Keys of ``state`` that ``index`` lacks but whose tied partner it has."""
    for group in tied_groups(state):
        if any(k in index.tensors for k in group):
            yield from (k for k in group if k not in index.tensors)


def load_safetensors(state: dict, source: str | os.PathLike, *, prefix: str = "", strict: bool = True,
                     max_read_bytes: int = 64 << 20) -> LoadStats:
    """Fill ``state``'s tensors in place from full tensors in safetensors files; collective.

    ``source``: a ``.safetensors`` file or a Hugging Face folder. File tensor ``n`` fills key
    ``prefix + n`` (``prefix=""`` for a flat model state dict); each rank reads only what its
    shards need. Errors as in `load`; ``strict`` counts a tied partner as loaded ([Note: tied
    weights]).
    """
    files, error = None, None
    try:
        files = hf_files(source, prefix)
        drop = set(_tied_missing(state, files.index))
        if drop:
            state = _without(state, drop)
    except Exception as e:
        error = e
    try:
        agree(error, f"loading safetensors from {source}")
        assert files is not None  # else agree raised
        return load_from_index(state, files, strict=strict, verify=False, max_read_bytes=max_read_bytes,
                               where=f"safetensors {os.fspath(source)}")
    finally:
        if files is not None:
            files.close()
