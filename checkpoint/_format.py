"""The checkpoint index: what ``index.json`` holds, how it is read, checked and written.

The format itself is specified in ``docs/checkpoint-format.md``; this module is its code.
An `Index` maps every tensor's flat key (see ``_flatten.py``) to a `TensorEntry` (dtype, global
shape, the layout it was saved from, and its saved boxes, each a `SavedBox`: a box, the data
file and safetensors key holding it, the CRC-32 of its bytes and, for a box of several
checksum chunks, the chunks' rows and CRC-32s, see [Note: checksum chunks] in
``_checksums.py``), and every plain value's flat key to its JSON value. ``files`` records
each data file's size in bytes, so a truncated or missing file is found before any data is
read.

`read_index` refuses, with a `CheckpointError` that says what the directory is and what to
do, anything that is not a complete checkpoint of a version this code reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ._boxes import Box
from ._checksums import box_rows, chunk_count, crcs_from_hex, crcs_to_hex
from ._comm import CheckpointError
from ._safetensors_io import DTYPE_CODES

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "INDEX_FILE", "Index", "SavedBox", "TensorEntry",
    "dtype_name", "dtype_from_name", "read_index", "index_to_json", "format_index", "write_json", "data_file_name",
]

FORMAT_NAME = "shardwise.checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
INCOMPLETE_MARK = ".incomplete-"


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


@dataclass(frozen=True)
class SavedBox:
    """A saved box: where it lies in the tensor, where its bytes are, and their checksums.

    ``chunk_rows``/``chunk_crc32``: None when the box has no checksum chunks (one chunk, a
    checkpoint written before chunks existed, a Hugging Face file); else the rows per chunk
    ``R`` and the CRC-32 of each chunk ``i`` (rows ``[i * R, min((i + 1) * R, rows))``).
    """

    box: Box
    file: str  # relative to the checkpoint directory
    key: str  # safetensors key inside ``file``
    crc32: int | None  # of the box's bytes; None when unknown (e.g. a Hugging Face file)
    chunk_rows: int | None = None
    chunk_crc32: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: tuple[SavedBox, ...]
    layout: dict | None = None  # informational: {"mesh_shape", "mesh_dim_names", "placements"}

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Index:
    root: str
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int | None] = field(default_factory=dict)  # name -> bytes (None: unknown)
    world_size: int | None = None
    created_unix_ns: int | None = None
    version: int = FORMAT_VERSION


def _box_to_json(b: SavedBox) -> dict:
    out = {"offsets": list(b.box.offsets), "sizes": list(b.box.sizes), "file": b.file, "key": b.key,
           "crc32": None if b.crc32 is None else f"{b.crc32:08x}"}
    if b.chunk_crc32 is not None:
        out["chunk_rows"] = b.chunk_rows
        out["chunk_crc32"] = crcs_to_hex(b.chunk_crc32)
    return out


def _ints(v, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"{what} must be a list of non-negative integers, got {v!r}")
    return tuple(v)


def _box_from_json(b: dict, tensor: str, file: str) -> SavedBox:
    box = Box(_ints(b["offsets"], f"tensor '{tensor}': 'offsets'"), _ints(b["sizes"], f"tensor '{tensor}': 'sizes'"))
    crc = None if b.get("crc32") is None else int(b["crc32"], 16)
    rows, chunks = b.get("chunk_rows"), b.get("chunk_crc32")
    if rows is None and chunks is None:
        return SavedBox(box, b["file"], b["key"], crc)
    where = f"{file} is damaged: tensor '{tensor}' box at {list(box.offsets)} (key '{b['key']}')"
    if rows is None or chunks is None:
        raise CheckpointError(f"{where} has only one of 'chunk_rows' and 'chunk_crc32'; both or neither are needed")
    total = box_rows(box.sizes)[0]
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise CheckpointError(f"{where}: 'chunk_rows' must be an integer >= 1, got {rows!r}")
    try:
        crcs = crcs_from_hex(chunks, chunk_count(total, rows))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e} (a box of {total} rows in chunks of {rows} rows)") from None
    return SavedBox(box, b["file"], b["key"], crc, rows, crcs)


def index_to_json(index: Index) -> dict:
    tensors = {}
    for key, t in index.tensors.items():
        tensors[key] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "layout": t.layout,
            "boxes": [_box_to_json(b) for b in t.boxes],
        }
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_unix_ns": index.created_unix_ns,
        "world_size": index.world_size,
        "files": {name: {"bytes": size} for name, size in sorted(index.files.items())},
        "tensors": tensors,
        "values": index.values,
    }


def format_index(obj: dict) -> str:
    """The index as text: one line per top-level field, per file and per tensor."""

    def compact(v: Any) -> str:
        return json.dumps(v, separators=(", ", ": "))

    lines = []
    for k, v in obj.items():
        if isinstance(v, dict) and v and k in ("files", "tensors", "values"):
            inner = [f"  {json.dumps(name)}: {compact(item)}" for name, item in v.items()]
            lines.append(f"{json.dumps(k)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f"{json.dumps(k)}: {compact(v)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def write_json(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: to ``path + ".tmp"``, fsync, rename."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _describe_non_checkpoint(path: str) -> str:
    if not os.path.exists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is a file, not a checkpoint directory"
    if INCOMPLETE_MARK in os.path.basename(os.path.normpath(path)):
        return (f"{path} is an incomplete save (the saving job stopped before committing it; see the "
                "checkpoint with the same name without '.incomplete-...'); load the previous checkpoint instead")
    names = sorted(os.listdir(path))
    if any(n.endswith(".safetensors") for n in names):
        return (f"{path} has safetensors files but no {INDEX_FILE}, so it is not a shardwise checkpoint (an "
                "incomplete save or a Hugging Face folder? for the latter use load_safetensors)")
    return f"{path} is not a shardwise checkpoint: it has no {INDEX_FILE} (contents: {names[:8]})"


def read_index(path: str) -> Index:
    """Read and check ``path/index.json``."""
    file = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(file) or INCOMPLETE_MARK in os.path.basename(os.path.normpath(path)):
        raise CheckpointError(_describe_non_checkpoint(path))
    try:
        with open(file) as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the index is damaged") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{file} is not a {FORMAT_NAME} index (its 'format' is {raw.get('format')!r})"
                              if isinstance(raw, dict) else f"{file} is not a {FORMAT_NAME} index")
    version = raw.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format version {version!r}; this shardwise reads version "
                              f"{FORMAT_VERSION}. Use the shardwise release that wrote it")
    try:
        tensors = {}
        for key, t in raw["tensors"].items():
            boxes = tuple(_box_from_json(b, key, file) for b in t["boxes"])
            tensors[key] = TensorEntry(dtype_from_name(t["dtype"]), _ints(t["shape"], f"tensor '{key}': 'shape'"), boxes,
                                       t.get("layout"))
        files = {name: f.get("bytes") for name, f in raw.get("files", {}).items()}
        return Index(path, tensors, raw.get("values", {}), files, raw.get("world_size"),
                     raw.get("created_unix_ns"), version)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file} is damaged: {type(e).__name__}: {e}") from None
