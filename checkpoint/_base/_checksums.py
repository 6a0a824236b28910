"""Checksums of saved boxes: whole-box and per-chunk CRC-32s and their arithmetic.

[Note: checksum chunks]
Every saved box has a CRC-32 (zlib's) of its bytes. A box of more than one *chunk* also has each
chunk's: chunk ``i`` is rows ``[i * R, min((i + 1) * R, rows))`` along dim 0 (a 0-d box is one
row), one contiguous byte range of the safetensors entry. ``R`` (``chunk_rows``) is chosen at
save time by a `ChunkRule`:

    row_bytes = bytes of one dim-0 row of the box
    target    = clamp(box_bytes // per_box, min_bytes, max_bytes)
    R         = max(1, target // row_bytes)

The default (`CHUNK_RULE`: 64 KiB to 4 MiB, about 8 per box) cuts a box of up to 512 KiB into
64 KiB chunks, one of up to 32 MiB into about 8, larger ones into 4 MiB chunks; a one-chunk box
records none. Readers take ``chunk_rows`` from the index, so the rule can change without a
format change. The whole-box CRC is derived from the chunks' (`crc32_combine`), so a writer
checksums every byte once. Which rank checks what on load: ``_verify_shares.py``.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._errors import CheckpointError

__all__ = [
    "CHUNK_MAX_BYTES", "CHUNK_MIN_BYTES", "CHUNKS_PER_BOX", "CHUNK_RULE", "ChunkRule", "BoxChecksums", "ChunkedCrc",
    "default_chunk_rule", "box_rows", "chunk_count", "combine_chunks", "crc32_combine", "crcs_from_hex", "crcs_to_hex",
]

CHUNK_MAX_BYTES = 4 << 20
CHUNK_MIN_BYTES = 64 << 10
CHUNKS_PER_BOX = 8
_HEX = re.compile(r"[0-9a-fA-F]*")


def box_rows(sizes: Sequence[int]) -> tuple[int, int]:
    """``(rows, elements per row)`` of a box of ``sizes`` along dim 0; a 0-d box is one row."""
    per_row = 1
    for s in sizes[1:]:
        per_row *= s
    return (sizes[0], per_row) if sizes else (1, 1)


def chunk_count(rows: int, chunk_rows: int) -> int:
    return -(-rows // chunk_rows)


@dataclass(frozen=True)
class ChunkRule:
    """How many dim-0 rows a checksum chunk holds (see [Note: checksum chunks])."""

    max_bytes: int = CHUNK_MAX_BYTES
    min_bytes: int = CHUNK_MIN_BYTES
    per_box: int = CHUNKS_PER_BOX

    def chunk_rows(self, sizes: Sequence[int], itemsize: int) -> int | None:
        """``R`` for a box of ``sizes``, or None when the box is a single chunk."""
        rows, per_row = box_rows(sizes)
        row_bytes = per_row * itemsize
        if rows * row_bytes == 0:
            return None
        target = min(self.max_bytes, max(self.min_bytes, rows * row_bytes // max(self.per_box, 1)))
        r = max(1, target // row_bytes)
        return r if chunk_count(rows, r) > 1 else None


CHUNK_RULE = ChunkRule()


def default_chunk_rule() -> ChunkRule:
    """`CHUNK_RULE` as it is when called (tests replace it)."""
    return CHUNK_RULE


# -- CRC-32 arithmetic ------------------------------------------------------------------------
# zlib's CRC-32 is reflected: bit 31 of a value is the coefficient of x^0, bit 0 that of x^31.
_POLY = 0xEDB88320
_X0 = 1 << 31


def _mulmod(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (reflected representation)."""
    p = 0
    m = _X0
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x8n(n: int) -> int:
    """``x ** (8 * n)`` modulo the polynomial: appending ``n`` bytes shifts a CRC by this factor."""
    result, base = _X0, _X0 >> 8
    while n:
        if n & 1:
            result = _mulmod(result, base)
        base = _mulmod(base, base)
        n >>= 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1`` = CRC of ``A``, ``crc2`` = CRC of ``B`` and ``len(B)``."""
    return _mulmod(crc1, _x8n(len2)) ^ crc2


class ChunkedCrc:
    """CRC-32s of a stream of ``total`` bytes fed in pieces of any length: of every
    ``chunk_bytes`` bytes (the last chunk may be shorter) and, combined, of the whole."""

    def __init__(self, total: int, chunk_bytes: int | None = None) -> None:
        self.total = total
        self.chunk_bytes = chunk_bytes or max(total, 1)
        self.done = 0
        self._crcs: list[int] = []
        self._crc = 0
        self._left = min(self.chunk_bytes, total)

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if len(view) > self.total - self.done:
            raise ValueError(f"{len(view)} bytes given, only {self.total - self.done} of {self.total} remain")
        pos = 0
        while pos < len(view):
            take = min(self._left, len(view) - pos)
            self._crc = zlib.crc32(view[pos:pos + take], self._crc)
            pos += take
            self.done += take
            self._left -= take
            if self._left == 0:
                self._crcs.append(self._crc)
                self._crc = 0
                self._left = min(self.chunk_bytes, self.total - self.done)

    def chunks(self) -> tuple[int, ...]:
        if self.done != self.total:
            raise ValueError(f"{self.done} of {self.total} bytes given")
        return tuple(self._crcs)

    def whole(self) -> int:
        return combine_chunks(self.chunks(), self.chunk_bytes, self.total)


def combine_chunks(crcs: Sequence[int], chunk_bytes: int, total: int) -> int:
    """The CRC-32 of ``total`` bytes from the CRCs ``crcs`` of its chunks of ``chunk_bytes``
    (the last one shorter when ``chunk_bytes`` does not divide ``total``)."""
    if not crcs:
        return 0
    full, last = _x8n(chunk_bytes), _x8n(total - (len(crcs) - 1) * chunk_bytes)
    crc = crcs[0]
    for i in range(1, len(crcs)):
        crc = _mulmod(crc, full if i < len(crcs) - 1 else last) ^ crcs[i]
    return crc


@dataclass(frozen=True)
class BoxChecksums:
    """What a writer records for one box: its CRC-32 and, with several chunks, theirs."""

    crc32: int
    chunk_rows: int | None = None
    chunk_crc32: tuple[int, ...] | None = None


def crcs_to_hex(crcs: Iterable[int]) -> str:
    return "".join(f"{c:08x}" for c in crcs)


def crcs_from_hex(text: object, count: int) -> tuple[int, ...]:
    """``count`` CRCs from 8 hex digits each; `CheckpointError` saying what is wrong otherwise."""
    if not isinstance(text, str) or not _HEX.fullmatch(text):
        raise CheckpointError(f"'chunk_crc32' must be a string of hex digits, got {str(text)[:40]!r}")
    if len(text) != 8 * count:
        raise CheckpointError(f"'chunk_crc32' has {len(text)} hex digits; {count} chunks need {8 * count}")
    return struct.unpack(f">{count}I", bytes.fromhex(text))
