"""Safetensors files written as a stream, and their headers read without torch.

A safetensors file is: 8 bytes (little-endian u64) giving the header length ``N``; ``N``
bytes of JSON mapping each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus
an optional ``"__metadata__"`` map of strings), padded with spaces so that the data starts on
an 8-byte boundary; then the data: each tensor's bytes, row-major, little-endian, tensors back
to back in the order of their offsets, no gaps.

Because every entry's dtype and shape are known before any byte is written, the header can go
first and each tensor can then be appended in pieces (`StreamingWriter.append`): no whole
file, and not even a whole tensor, has to be in memory at once. The writer computes the CRC-32
of each checksum chunk of every entry as the bytes pass, whatever the length of the pieces,
and from them the CRC-32 of the entry ([Note: checksum chunks] in ``_checksums.py``). Files
written so are ordinary safetensors files (``safetensors.safe_open`` and ``load_file`` read
them).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import _checksums
from ._checksums import BoxChecksums, ChunkedCrc, ChunkRule, box_rows
from ._errors import CheckpointError

__all__ = [
    "DTYPE_CODES", "StreamingWriter", "Header", "read_header", "crcs_of_range", "crcs_of_ranges", "adjacent_groups",
    "read_pieces", "tensor_bytes", "contiguous_run", "open_for_ranges", "data_file_size", "pread_into", "preadv_into", "byte_view",
]

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
    CRC-32 and, when ``chunk_rule`` (default ``_checksums.CHUNK_RULE``) cuts it into several
    chunks of dim-0 rows, the CRC-32 of each chunk.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, chunk_rule: ChunkRule | None = None) -> None:
        rule = chunk_rule or _checksums.CHUNK_RULE
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
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self.keys = [k for k, _, _ in self._order]  # the order in which `append` expects the data
        self._i, self._crc, self.checksums = 0, ChunkedCrc(0), {}
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
        self._file.flush()
        os.fsync(self._file.fileno())
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


def data_file_size(path: str, follow: bool = True) -> int:
    """The size of the data file ``path``, which must be a regular file: a `CheckpointError`
    says when it is missing, not a regular file, unreadable, or (``follow=False``, as for every
    file of a shardwise checkpoint) a symbolic link, refused because it could point anywhere.
    Hugging Face folders (``follow=True``) are often symlinks into a download cache."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"data file {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"data file {path}: {e.strerror or type(e).__name__}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"data file {path} is a symbolic link; data files must be regular files inside the "
                              "checkpoint directory (refusing to follow it)")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"data file {path} is not a regular file")
    return st.st_size


def open_for_ranges(path: str, follow: bool = True) -> int:
    """An fd for reading byte ranges of the regular file ``path`` (with ``follow=False`` never
    through a symbolic link): the kernel is told not to read ahead past them (a read ahead of several MiB would
    otherwise pull in neighbouring boxes this rank does not need)."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    except FileNotFoundError:
        raise CheckpointError(f"data file {path} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"data file {path} is a symbolic link; refusing to follow it") from None
        raise CheckpointError(f"data file {path}: {e.strerror or type(e).__name__}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"data file {path} is not a regular file")
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _pread(fd: int, n: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < n:
        data = os.pread(fd, n - done, offset + done)
        if not data:
            break
        parts.append(data)
        done += len(data)
    return b"".join(parts)


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


def read_header(path: str, follow: bool = True) -> Header:
    """Parse and check a safetensors header; a `CheckpointError` names ``path`` on any problem,
    including a file shorter than its header declares (truncated). Nothing is allocated beyond
    what the file's size allows, and no byte of the file appears in a message."""
    fd = open_for_ranges(path, follow)
    try:
        size = os.fstat(fd).st_size
        head = _pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file, or truncated (its header length field does not "
                                  f"fit in the {size}-byte file)")
        raw = json.loads(_pread(fd, n, 8).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not valid JSON, or repeats a key)") from None
    finally:
        os.close(fd)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: not a valid safetensors header ('__metadata__' is not an object)")
    entries, end = {}, 0
    for key, e in raw.items():
        entries[key] = _entry(path, key, e)
        end = max(end, entries[key].end)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated: the header declares {8 + n + end} bytes, the file has {size}")
    return Header(entries, 8 + n, end, metadata)


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError("duplicate key")
        out[k] = v
    return out


def read_pieces(fd: int, begin: int, end: int, path: str, piece: int = 4 << 20,
                buf: memoryview | None = None) -> Iterator[memoryview]:
    """Bytes ``[begin, end)`` of the open file ``fd`` (named ``path``), at most ``piece`` bytes at
    a time (or ``len(buf)``, when a byte buffer ``buf`` to reuse is given). Every piece is a view
    of that one buffer: it is valid until the next is read."""
    if buf is None:
        buf = memoryview(bytearray(max(0, min(piece, end - begin))))
    pos = begin
    while pos < end:
        n = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
        if n <= 0:
            raise CheckpointError(f"{path}: truncated: ended {end - pos} bytes before offset {end}")
        yield buf[:n]
        pos += n


def crcs_of_range(fd: int, begin: int, end: int, path: str, chunk_bytes: int | None = None) -> ChunkedCrc:
    """The CRC-32s of bytes ``[begin, end)`` of ``fd`` (named ``path``): of every ``chunk_bytes``
    (all of them when None) and of the whole; one piece of at most 4 MiB in memory."""
    crc = ChunkedCrc(end - begin, chunk_bytes)
    for data in read_pieces(fd, begin, end, path):
        crc.update(data)
    return crc


def adjacent_groups(spans: list[tuple[int, int]]) -> list[list[int]]:
    """The indices of the byte ranges ``spans`` (``(begin, end)``), in file order, grouped into
    runs whose ranges follow one another with no gap (each run can be read as one range)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        if groups and spans[groups[-1][-1]][1] == spans[i][0]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def crcs_of_ranges(fd: int, ranges: list[tuple[int, int, int | None]], path: str) -> list[ChunkedCrc]:
    """`crcs_of_range` for each ``(begin, end, chunk_bytes)`` of ``ranges``, in that order.
    Ranges that follow one another in the file (in any order in ``ranges``) are read together,
    4 MiB at a time, so many small adjacent ranges cost a few large reads."""
    crcs = [ChunkedCrc(end - begin, chunk) for begin, end, chunk in ranges]
    groups = adjacent_groups([(begin, end) for begin, end, _ in ranges])
    spans = [(ranges[g[0]][0], ranges[g[-1]][1]) for g in groups]
    buf = memoryview(bytearray(min(4 << 20, max((e - b for b, e in spans), default=0))))
    for group, (begin, end) in zip(groups, spans):
        j = 0
        for data in read_pieces(fd, begin, end, path, buf=buf):
            pos = 0
            while pos < len(data):
                while crcs[group[j]].done == crcs[group[j]].total:
                    j += 1
                crc = crcs[group[j]]
                take = min(crc.total - crc.done, len(data) - pos)
                crc.update(data[pos : pos + take])
                pos += take
    return crcs


def contiguous_run(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` if the region ``offsets``/``sizes`` of a row-major
    tensor of ``shape`` is one contiguous run of its elements, else None.

    It is when, for some dimension ``k``, the region has one index in every dimension before
    ``k`` and all indices in every dimension after ``k``.
    """
    k = 0
    while k < len(sizes) and sizes[k] == 1 and k + 1 < len(sizes):
        k += 1
    if any(o != 0 or n != full for o, n, full in zip(offsets[k + 1:], sizes[k + 1:], shape[k + 1:])):
        return None
    first, stride = 0, 1
    for o, n in zip(reversed(offsets), reversed(shape)):
        first += o * stride
        stride *= n
    count = 1
    for n in sizes:
        count *= n
    return first, count


_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t`` as a writable memoryview (no copy).

    Built on ctypes rather than ``Tensor.numpy()``: numpy is not a dependency of shardwise,
    and a fresh environment need not have it. The view keeps ``t`` alive.
    """
    flat = t.detach().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    buf = (ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())
    buf._owner = flat  # the memoryview holds buf, buf holds the tensor's storage
    return memoryview(buf).cast("B")


def preadv_into(fd: int, views: list[memoryview], offset: int, path: str) -> int:
    """Fill the byte buffers ``views``, in order, from consecutive bytes of ``fd`` starting at
    ``offset``: one ``preadv`` system call for up to 1024 buffers (short reads resumed).
    Returns the number of bytes read."""
    views = [v for v in views if len(v)]
    i, pos = 0, offset
    while i < len(views):
        n = os.preadv(fd, views[i : i + _IOV_MAX], pos)
        if n <= 0:
            raise CheckpointError(f"{path}: truncated: no data at byte {pos}")
        pos += n
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0
    return pos - offset


def pread_into(fd: int, out: torch.Tensor, offset: int, path: str) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``fd`` at ``offset``."""
    preadv_into(fd, [byte_view(out)], offset, path)
