"""Safetensors files written as a stream, and their headers read without torch.

A safetensors file is: 8 bytes (little-endian u64) header length ``N``; ``N`` bytes of JSON mapping
each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus optional ``"__metadata__"``),
space-padded so the data starts 8-byte aligned; then the tensors' row-major little-endian bytes,
back to back. Since dtypes and shapes are known first, the header goes first and each tensor is
appended in pieces (`StreamingWriter.append`), never whole in memory, with the CRC-32 of each
checksum chunk computed as the bytes pass ([Note: checksum chunks] in
``checkpoint/_base/_checksums.py``). The files are ordinary safetensors files. Byte-range reads
are in ``_file_io.py``.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .._base import (BoxChecksums, CheckpointError, ChunkRule, ChunkedCrc, box_rows, default_chunk_rule,
                     parse_json_strict)
from ._file_io import byte_view, pread_exact
from .._storage import PosixStorage, ReadHandle, Storage

__all__ = ["DTYPE_CODES", "Entry", "Header", "StreamingWriter", "read_header", "tensor_bytes"]

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_ALIGN = 8


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
_MAX_HEADER = 100 << 20

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("shardwise.checkpoint writes little-endian safetensors and needs a little-endian machine")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` (copied to a contiguous CPU tensor if needed)."""
    return byte_view(t.detach().to("cpu").contiguous())


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data
    end: int


class StreamingWriter:
    """Write one safetensors file whose entries are declared up front and filled in order.

    ``entries`` is ``[(key, dtype, shape)]``; the file stores them widest dtype first (so that
    every tensor is aligned to its element size) and ``keys`` lists that order. `append` takes
    the tensors in that order, whole or in row-major pieces of any length; `close` checks that
    every byte was written, fsyncs the file and returns ``{key: BoxChecksums}``: each entry's
    CRC-32 and, when ``chunk_rule`` (default ``CHUNK_RULE`` in ``_base/_checksums.py``) cuts it into several
    chunks of dim-0 rows, the CRC-32 of each chunk.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, chunk_rule: ChunkRule | None = None,
                 storage: Storage | None = None) -> None:
        rule = chunk_rule or default_chunk_rule()
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._order: list[tuple[str, torch.dtype, int]] = []
        self._chunks: dict[str, tuple[int | None, int | None]] = {}  # key -> (rows, bytes) per chunk
        pos = 0
        # widest dtypes first: every tensor then starts at a multiple of its element size
        entries = sorted(entries, key=lambda e: -_itemsize(e[1]) if e[1] in DTYPE_CODES else 0)
        for key, dtype, shape in entries:
            if dtype not in DTYPE_CODES:
                raise CheckpointError(f"tensor '{key}' has dtype {dtype}, which safetensors cannot store")
            n = 1
            for s in shape:
                n *= s
            size = n * _itemsize(dtype)
            header[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + size]}
            self._order.append((key, dtype, size))
            rows = rule.chunk_rows(tuple(shape), _itemsize(dtype))
            self._chunks[key] = (rows, rows * box_rows(tuple(shape))[1] * _itemsize(dtype) if rows else None)
            pos += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
        self.path = path
        self._file = (storage or PosixStorage()).open_write(path)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self.keys = [k for k, _, _ in self._order]  # the order in which `append` expects the data
        self._i, self._crc = 0, ChunkedCrc(0)
        self.checksums: dict[str, BoxChecksums] = {}
        self._start_entry()

    def _start_entry(self) -> None:
        while self._i < len(self._order) and self._order[self._i][2] == 0:
            self.checksums[self._order[self._i][0]] = BoxChecksums(0)  # empty tensors have no bytes
            self._i += 1
        if self._i < len(self._order):
            key, _, size = self._order[self._i]
            self._crc = ChunkedCrc(size, self._chunks[key][1])

    def append(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return  # empty entries are complete from the start
        if self._i >= len(self._order):
            raise CheckpointError(f"{self.path}: more data appended than the header declares")
        key, dtype, _ = self._order[self._i]
        if t.dtype != dtype:
            raise CheckpointError(f"{self.path}: tensor '{key}' declared {dtype} but got {t.dtype}")
        data = tensor_bytes(t)
        crc = self._crc
        if len(data) > crc.total - crc.done:
            raise CheckpointError(f"{self.path}: tensor '{key}' got more bytes than its shape declares")
        self._file.write(data)
        crc.update(data)
        if crc.done == crc.total:
            rows = self._chunks[key][0]
            self.checksums[key] = BoxChecksums(crc.whole(), rows, crc.chunks() if rows else None)
            self._i += 1
            self._start_entry()

    def close(self) -> dict[str, BoxChecksums]:
        if self._i < len(self._order):
            self._file.close()
            raise CheckpointError(f"{self.path}: tensor '{self._order[self._i][0]}' was not completely written")
        self._file.sync()
        self._file.close()
        return self.checksums

    def abort(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class Header:
    entries: dict[str, Entry]
    data_start: int  # absolute byte offset of the data
    data_size: int  # bytes of data the header declares
    metadata: dict[str, str]


_FROM_CODE_SIZE = {code: _itemsize(dtype) for dtype, code in DTYPE_CODES.items()}


def _entry(path: str, key: Any, e: Any) -> Entry:
    """One header entry, checked: known dtype, shape of non-negative ints, offsets that hold
    exactly the shape's bytes (no content of the file is echoed in a message)."""
    where = f"{path}: not a valid safetensors header: entry"
    if not isinstance(e, dict):
        raise CheckpointError(f"{where} is not an object")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in _FROM_CODE_SIZE:
        raise CheckpointError(f"{where} has no known dtype")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise CheckpointError(f"{where} has no valid shape")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in offsets)
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{where} has no valid data_offsets")
    numel = 1
    for n in shape:
        numel *= n
    if numel * _FROM_CODE_SIZE[dtype] != offsets[1] - offsets[0]:
        raise CheckpointError(f"{where} has data_offsets that do not match its dtype and shape")
    return Entry(dtype, tuple(shape), offsets[0], offsets[1])


def _overlap(path: str, entries: dict[str, Entry]) -> None:
    """Refuse entries whose byte ranges overlap (the safetensors library refuses them too): two
    keys reading the same bytes would let a damaged header serve one tensor's data as another's."""
    spans = sorted((e.begin, e.end) for e in entries.values() if e.end > e.begin)
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: not a valid safetensors header: two entries' data_offsets overlap")


def read_header(h: ReadHandle | str) -> Header:
    """Parse and check the safetensors header of the open file ``h``; a `CheckpointError` names
    the file on any problem, including a file shorter than its header declares (truncated) and
    entries whose byte ranges overlap. Nothing is allocated beyond what the file's size allows,
    and no byte of the file appears in a message. A ``str`` is a local file's path."""
    if isinstance(h, str):
        handle = PosixStorage().open_read(h)
        try:
            return read_header(handle)
        finally:
            handle.close()
    path, size = h.name, h.size
    try:
        head = pread_exact(h, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated (its header length field does not "
                                  f"fit in the {size}-byte file)")
        raw = parse_json_strict(pread_exact(h, n, 8).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not valid JSON, or repeats a key)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: not a valid safetensors header ('__metadata__' is not an object)")
    entries, end = {}, 0
    for key, e in raw.items():
        entries[key] = _entry(path, key, e)
        end = max(end, entries[key].end)
    _overlap(path, entries)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: the header declares {8 + n + end} bytes, the file has {size}")
    return Header(entries, 8 + n, end, metadata)
