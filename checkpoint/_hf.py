"""Hugging Face style safetensors: load them into (sharded) state without holding them whole.

A Hugging Face model folder holds either one ``model.safetensors`` or several
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``{"metadata":
{...}, "weight_map": {name: file}}``); each file holds full tensors by name. `hf_index`
describes such files as an `Index` in which every tensor is one saved box covering all of it
(no checksums), so the ordinary load path (``_reader.load_from_index``) applies: each rank
reads only the slices of each tensor that its shards need, and no rank holds the full state.

``merge_checkpoint`` (``_offline.py``) writes this layout.
"""

from __future__ import annotations

import json
import os

from ._boxes import Box
from ._comm import CheckpointError, agree
from ._format import Index, SavedBox, TensorEntry
from ._reader import LoadStats, load_from_index
from ._safetensors_io import DTYPE_CODES, read_header

__all__ = ["HF_INDEX_FILE", "hf_index", "load_safetensors"]

HF_INDEX_FILE = "model.safetensors.index.json"
_FROM_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def _files(source: str) -> tuple[str, list[str]]:
    if os.path.isfile(source):
        return os.path.dirname(source), [os.path.basename(source)]
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} does not exist")
    index_file = os.path.join(source, HF_INDEX_FILE)
    if os.path.isfile(index_file):
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


def hf_index(source: str | os.PathLike, prefix: str = "") -> Index:
    """An `Index` of the tensors in a safetensors file or Hugging Face folder, each tensor's flat
    key being ``prefix + name``."""
    root, names = _files(os.path.abspath(os.fspath(source)))
    tensors: dict[str, TensorEntry] = {}
    for name in names:
        header = read_header(os.path.join(root, name))
        for key, e in header.entries.items():
            if e.dtype not in _FROM_CODE:
                raise CheckpointError(f"{os.path.join(root, name)}: tensor '{key}' has dtype {e.dtype}, unknown here")
            if prefix + key in tensors:
                raise CheckpointError(f"tensor '{key}' appears in {name} and in {tensors[prefix + key].boxes[0].file}")
            box = SavedBox(Box((0,) * len(e.shape), e.shape), name, key, None)
            tensors[prefix + key] = TensorEntry(_FROM_CODE[e.dtype], e.shape, (box,) if 0 not in e.shape else ())
    return Index(root, tensors)


def load_safetensors(state: dict, source: str | os.PathLike, *, prefix: str = "", strict: bool = True,
                     max_read_bytes: int = 64 << 20) -> LoadStats:
    """Fill ``state``'s tensors in place from full tensors in safetensors files; collective.

    ``source`` is a ``.safetensors`` file or a folder (Hugging Face layout, see the module
    docstring). The tensor named ``n`` in the files fills the key ``prefix + n`` of ``state``
    (e.g. ``load_safetensors({"model": sd}, folder, prefix="model/")``, or ``prefix=""`` for a
    flat model state dict). Each rank reads only the slices its shards need. Errors as in `load`.
    """
    index, error = None, None
    try:
        index = hf_index(source, prefix)
    except CheckpointError as e:
        error = e
    agree(error, f"loading safetensors from {source}")
    return load_from_index(state, index, strict=strict, verify=False, max_read_bytes=max_read_bytes,
                           where=f"safetensors {os.fspath(source)}")
