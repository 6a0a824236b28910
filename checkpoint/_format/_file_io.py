"""Byte ranges of data files: opening them safely, reading ranges into tensors, CRC-32s of ranges.

Every read of a data file goes through here, on a storage's `ReadHandle` ([Note: storage
semantics] in ``_storage/_protocol.py``): `pread_into`/`preadv_into` fill tensors' bytes
(`byte_view`) straight from the file; `crcs_of_range`/`crcs_of_ranges` checksum 4 MiB at a time,
adjacent ranges together (`adjacent_groups`); `contiguous_run` says whether a region of a
row-major box is one byte range.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence

import torch

from .._base import CheckpointError, ChunkedCrc
from .._storage import ReadHandle

__all__ = [
    "adjacent_groups", "byte_view", "contiguous_run", "crcs_of_range", "crcs_of_ranges",
    "pread_exact", "pread_into",
    "preadv_into", "read_pieces",
]


def pread_exact(h: ReadHandle, n: int, offset: int) -> bytes:
    """``n`` bytes of ``h`` from ``offset`` (fewer only at the end of the file), short reads resumed."""
    parts, done = [], 0
    while done < n:
        data = h.read(n - done, offset + done)
        if not data:
            break
        parts.append(data)
        done += len(data)
    return b"".join(parts)


def read_pieces(fd: ReadHandle, begin: int, end: int, path: str, piece: int = 4 << 20,
                buf: memoryview | None = None) -> Iterator[memoryview]:
    """Bytes ``[begin, end)`` of the open file ``fd`` (named ``path``), at most ``piece`` bytes at
    a time (or ``len(buf)``, when a byte buffer ``buf`` to reuse is given). Every piece is a view
    of that one buffer: it is valid until the next is read."""
    if buf is None:
        buf = memoryview(bytearray(max(0, min(piece, end - begin))))
    pos = begin
    while pos < end:
        n = fd.readinto([buf[: min(len(buf), end - pos)]], pos)
        if n <= 0:
            raise CheckpointError(f"{path}: truncated: ended {end - pos} bytes before offset {end}")
        yield buf[:n]
        pos += n


def crcs_of_range(fd: ReadHandle, begin: int, end: int, path: str, chunk_bytes: int | None = None) -> ChunkedCrc:
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


def crcs_of_ranges(fd: ReadHandle, ranges: Sequence[tuple[int, int, int | None]], path: str) -> list[ChunkedCrc]:
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
    buf._owner = flat  # type: ignore[attr-defined]  # the memoryview holds buf, buf holds the tensor's storage
    return memoryview(buf).cast("B")


def preadv_into(fd: ReadHandle, views: list[memoryview], offset: int, path: str) -> int:
    """Fill the byte buffers ``views``, in order, from consecutive bytes of ``fd`` starting at
    ``offset``: one request (``preadv`` on POSIX) for up to 1024 buffers (short reads resumed).
    Returns the number of bytes read."""
    views = [v for v in views if len(v)]
    i, pos = 0, offset
    while i < len(views):
        n = fd.readinto(views[i : i + _IOV_MAX], pos)
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


def pread_into(fd: ReadHandle, out: torch.Tensor, offset: int, path: str) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``fd`` at ``offset``."""
    preadv_into(fd, [byte_view(out)], offset, path)
