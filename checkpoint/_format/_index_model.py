"""The checkpoint index's records and names: `Index`, `TensorEntry`, `SavedBox` (frozen), the
format's name, version and file names, the dtype names and what a data file may be called.
Reading, checking and writing ``index.json`` is ``_index.py``; see its docstring for what the
records hold."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base import CheckpointError
from .._geometry import Box
from ._safetensors_io import DTYPE_CODES

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "PARTS_VERSION", "PART_SUFFIX", "READ_VERSIONS", "INDEX_FILE", "INCOMPLETE_MARK", "CHECKSUM_FIELD", "DCP_MARKER", "Index",
           "POINTER_VERSION", "VERSION_MARK", "pointer_bytes", "pointer_at",
           "SavedBox", "TensorEntry", "dcp_marker", "data_file_name", "part_file_name", "dtype_name", "dtype_from_name", "plain_file_name"]

FORMAT_NAME = "shardwise.checkpoint"
FORMAT_VERSION = 1  # an index holding every box itself
PARTS_VERSION = 2  # an index whose boxes are in index parts ([Note: index parts] in ``_index.py``)
READ_VERSIONS = (FORMAT_VERSION, PARTS_VERSION)
PART_SUFFIX = ".boxes.json"  # the end of an index part's name (`part_file_name`)
INDEX_FILE = "index.json"
INCOMPLETE_MARK = ".incomplete-"
POINTER_VERSION = 3  # an index.json that names the folder holding the index: [Note: commit by a pointer]
VERSION_MARK = ".v-"  # a save's own folder inside the checkpoint, on a store without rename: ``.v-<token>``
CHECKSUM_FIELD = "index_sha256"
DCP_MARKER = ".metadata"  # [Note: the .metadata marker]
_DCP_REFUSAL = ("this is a shardwise checkpoint (index.json and safetensors files), not a torch DCP one; its .metadata "
                "only marks it for tools that look for DCP's: load it with shardwise.checkpoint.load(state, path)")


def dcp_marker() -> bytes:
    """The bytes of a checkpoint's ``.metadata``.

    [Note: the .metadata marker]
    Code that looks for torch DCP checkpoints (torchtitan finds its newest one) tests for a
    ``.metadata`` file, so a save writes one. torch's ``dcp.load`` unpickles that file; a
    shardwise checkpoint cannot be read that way (its data files are safetensors, not DCP's), so
    the marker is the smallest pickle stream that stops that load with our sentence: ``int(<the
    sentence>)`` raises ``ValueError: invalid literal for int() ...: '<the sentence>'`` before any
    tensor is touched. shardwise never reads the file (``import_dcp`` refuses a folder holding
    ``index.json`` first)."""
    text = _DCP_REFUSAL.encode()
    return b"\x80\x02cbuiltins\nint\nX" + len(text).to_bytes(4, "little") + text + b"\x85R."


def pointer_bytes(token: str) -> bytes:
    """The ``index.json`` that makes a checkpoint the save ``token`` whose files are in its folder
    ``.v-<token>`` ([Note: commit by a pointer] in ``checkpoint/_series/_commit.py``)."""
    return json.dumps({"format": FORMAT_NAME, "version": POINTER_VERSION, "at": VERSION_MARK + token,
                       "save_id": token}).encode() + b"\n"


def pointer_at(raw: object) -> str | None:
    """The version folder an ``index.json`` that is a pointer names (a plain ``.v-<hex>`` name),
    else None."""
    if not isinstance(raw, dict) or raw.get("version") != POINTER_VERSION or raw.get("format") != FORMAT_NAME:
        return None
    at = raw.get("at")
    ok = isinstance(at, str) and at.startswith(VERSION_MARK) and plain_file_name(at[1:])
    return at if ok else None


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def part_file_name(rank: int) -> str:
    """The index part of rank ``rank``'s boxes ([Note: index parts] in ``_index.py``)."""
    return f"rank-{rank:05d}{PART_SUFFIX}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise CheckpointError(f"unknown dtype {str(name)[:40]!r} in the checkpoint index")
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
    """What an ``index.json`` says (nothing about where it was read from: the storage and the
    directory are the reader's, ``_files.CheckpointFiles``)."""

    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int | None] = field(default_factory=dict)  # name -> bytes (None: unknown)
    world_size: int | None = None
    created_unix_ns: int | None = None
    version: int = FORMAT_VERSION
    checksummed: bool = False  # the index carried its own checksum and it matched
    save_id: str | None = None  # the save that wrote it (rotation compares it with the series record)
    blobs: frozenset[str] = frozenset()  # tensors (uint8, 1-D) that hold a ``bytes`` value
    # index parts holding boxes that ``tensors`` does not: name -> (bytes, sha256). Set on the
    # index a save builds ([Note: index parts] in ``_index.py``); an index read has its parts'
    # boxes in ``tensors`` and this empty (``version`` says it had parts)
    parts: dict[str, tuple[int, str]] = field(default_factory=dict)


def plain_file_name(name: Any) -> bool:
    """Whether ``name`` may name a data file: a plain file name inside the checkpoint directory
    (no directory part, not absolute, not ``.``/``..``, no NUL, not hidden)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\0" not in name and not name.startswith("."))
