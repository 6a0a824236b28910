"""Checksums of saved boxes: whole-box and per-chunk CRC-32s, and who checks which on load.

[Note: checksum chunks]
Every saved box has a CRC-32 (as in zlib/PNG) of its bytes. A box whose bytes are more than
one *chunk* also has the CRC-32 of each chunk: chunk ``i`` is rows ``[i * R, min((i + 1) * R,
rows))`` along dim 0 of the box (a 0-d box is one row), so it is one contiguous byte range of
the safetensors entry. ``R`` (``chunk_rows``) is chosen at save time by a `ChunkRule`:

    row_bytes = bytes of one dim-0 row of the box
    target    = clamp(box_bytes // per_box, min_bytes, max_bytes)
    R         = max(1, target // row_bytes)

With the default rule (`CHUNK_RULE`: at most 4 MiB, at least 64 KiB, about 8 per box) a box
of up to 512 KiB is cut into chunks of 64 KiB, one of up to 32 MiB into about 8, and a larger
one into 4 MiB chunks; a box of one chunk records none. A reader never recomputes ``R``: it
takes ``chunk_rows`` from the index, so the rule can change without a format change. The
index stores the chunk CRCs as one string of 8 hex digits per chunk, so its size grows by at
most 16 x 8 characters per box plus 8 per 4 MiB of data.

The whole-box CRC is derived from the chunk CRCs (`crc32_combine`, as zlib's), so a writer
checksums every byte once.

[Note: verification shares]
With ``verify`` every checksum *unit* of the loaded tensors (a chunk, or a whole box when the
box has no chunks) is checked by exactly one rank, before any rank writes. Each rank sends
the others, in one all-gather, the set of tensors it loads (a bit mask over the index's sorted
keys, `keys_to_mask`) and the dim-0 row ranges it reads from every saved box (`needs_of`, boxes
numbered by `box_ids`, which depends on the index alone). Ranks may load different tensors
(pipeline stages, ``strict=False``): the units are those of the union of the sets. From the
same gathered lists every rank works out its own share (`share_of`): a unit goes to the rank
that reads the most of its bytes anyway; among equals (a replicated tensor that every rank
reads) to one picked by the box and chunk, so such boxes spread over the ranks; a unit nobody
reads goes round-robin. A rank thus re-reads for checking only the parts of the few chunks
that straddle its shard's boundaries (none when they fall on chunk boundaries). The work is
per saved box and reader boundary (`owned_chunks`), not per chunk of the checkpoint.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._comm import CheckpointError

if TYPE_CHECKING:
    from ._boxes import Box
    from ._format import Index, SavedBox

__all__ = [
    "CHUNK_MAX_BYTES", "CHUNK_MIN_BYTES", "CHUNKS_PER_BOX", "CHUNK_RULE", "ChunkRule", "BoxChecksums", "ChunkedCrc",
    "Unit", "box_ids", "box_rows", "chunk_bounds", "chunk_count", "combine_chunks", "contiguous_runs", "crc32_combine",
    "crcs_from_hex", "crcs_to_hex", "keys_to_mask", "mask_to_keys", "needs_of", "owned_chunks", "share_of",
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


def chunk_bounds(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The row ranges ``[lo, hi)`` of the chunks of a box of ``rows`` rows."""
    return [(lo, min(lo + chunk_rows, rows)) for lo in range(0, rows, chunk_rows)]


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


# -- verification shares (see [Note: verification shares]) -------------------------------------

@dataclass(frozen=True)
class Unit:
    """One checksum check: rows ``[lo, hi)`` of saved box ``saved`` of tensor ``tensor``, chunk
    ``chunk`` of the box (None: the whole box, checked against ``saved.crc32``)."""

    tensor: str
    saved: SavedBox
    box_id: int
    chunk: int | None
    lo: int
    hi: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.row_bytes

    @property
    def crc32(self) -> int:
        return self.saved.crc32 if self.chunk is None else self.saved.chunk_crc32[self.chunk]

    def where(self) -> str:
        box = self.saved.box
        if self.chunk is None:
            return f"box at {list(box.offsets)}"
        first = box.offsets[0] if box.offsets else 0
        return (f"box at {list(box.offsets)}, chunk {self.chunk}: rows [{self.lo}, {self.hi}) of the box, "
                f"rows [{first + self.lo}, {first + self.hi}) of the tensor")


def box_ids(index: Index) -> dict[tuple[str, str], int]:
    """Every saved box's id: ``(file, key)`` -> its position among all boxes of the index, in
    sorted tensor-key order. It depends on the index alone, so it is the same on every rank
    whatever each rank loads."""
    ids: dict[tuple[str, str], int] = {}
    for k in sorted(index.tensors):
        for b in index.tensors[k].boxes:
            ids.setdefault((b.file, b.key), len(ids))
    return ids


def keys_to_mask(index: Index, keys: Iterable[str]) -> str:
    """The set ``keys`` of tensor keys as a hex bit mask over the sorted keys of the index
    (compact for the all-gather: one bit per tensor)."""
    pos = {k: i for i, k in enumerate(sorted(index.tensors))}
    mask = 0
    for k in keys:
        mask |= 1 << pos[k]
    return format(mask, "x")


def mask_to_keys(index: Index, masks: Iterable[str]) -> list[str]:
    """The union of the key sets ``masks`` (from `keys_to_mask`), in sorted order."""
    union = 0
    for m in masks:
        union |= int(m, 16)
    return [k for i, k in enumerate(sorted(index.tensors)) if union >> i & 1]


def needs_of(reads: Iterable[tuple[str, str, Box, int]], ids: dict[tuple[str, str], int]) -> list[int]:
    """What this rank reads, for the all-gather: ``[box id, first row, end row, bytes per row]``
    for each ``(file, key, region of the saved box, itemsize)`` in ``reads``, flattened."""
    out: list[int] = []
    for file, key, src, itemsize in reads:
        bid = ids.get((file, key))
        if bid is None:
            continue
        rows, per_row = box_rows(src.sizes)
        lo = src.offsets[0] if src.sizes else 0
        out += [bid, lo, lo + rows, per_row * itemsize]
    return out


def contiguous_runs(units: Iterable[Unit]) -> list[list[Unit]]:
    """``units`` grouped into runs of consecutive chunks of one box (each run in row order; a
    run's chunks are all of the box's chunk size except perhaps the box's last one)."""
    runs: list[list[Unit]] = []
    for u in sorted(units, key=lambda u: (u.box_id, u.lo)):
        if runs and runs[-1][-1].box_id == u.box_id and runs[-1][-1].hi == u.lo:
            runs[-1].append(u)
        else:
            runs.append([u])
    return runs


def share_of(index: Index, keys: Iterable[str], ids: dict[tuple[str, str], int], needs: Sequence[Sequence[int]],
             rank: int, world: int) -> list[Unit]:
    """The checksum units of the tensors ``keys`` that ``rank`` checks (see [Note: verification
    shares]); ``needs[r]`` is rank ``r``'s `needs_of`, boxes numbered by ``ids`` (`box_ids`).
    Every rank computes its share from the same arguments, and the shares of all ranks hold
    every unit exactly once. The work is per saved box and per reader boundary, plus the units
    this rank owns: not per unit of the whole checkpoint."""
    wants: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for r, flat in enumerate(needs):
        for j in range(0, len(flat), 4):
            bid, lo, hi, per_row = flat[j:j + 4]
            if hi > lo:
                wants[bid].append((r, lo, hi, per_row))
    reading = {bid for bid, readers in wants.items() if any(r == rank for r, _, _, _ in readers)}
    mine: list[Unit] = []
    for k in sorted(set(keys)):
        t = index.tensors[k]
        for b in t.boxes:
            bid = ids[(b.file, b.key)]
            readers = wants.get(bid, ())
            rows, per_row = box_rows(b.box.sizes)
            if bid not in reading and readers and _covered(readers, rows):
                continue  # read whole by other ranks: nothing of it is this rank's
            row_bytes = per_row * t.dtype.itemsize
            chunked = b.chunk_crc32 is not None
            if rows * row_bytes == 0 or (not chunked and b.crc32 is None):
                continue  # no bytes, or no checksum
            size = b.chunk_rows if chunked else rows
            for p, q in owned_chunks(readers, rows, size, bid, rank, world):
                mine += [Unit(k, b, bid, i if chunked else None, i * size, min((i + 1) * size, rows), row_bytes)
                         for i in range(p, q)]
    return mine


def _covered(readers: Sequence[tuple[int, int, int, int]], rows: int) -> bool:
    """Whether the row ranges of ``readers`` together cover rows ``[0, rows)``."""
    end = 0
    for _, lo, hi, _ in sorted(readers, key=lambda x: x[1]):
        if lo > end:
            return False
        end = max(end, hi)
    return end >= rows


def owned_chunks(readers: Sequence[tuple[int, int, int, int]], rows: int, size: int, salt: int, rank: int,
                 world: int) -> list[tuple[int, int]]:
    """The chunks (ranges ``[p, q)`` of chunk indices) that ``rank`` checks, of a box of ``rows``
    rows in chunks of ``size`` rows, read by ``readers`` ``[(rank, first row, end row, bytes per
    row)]`` (a rank may appear several times, for disjoint rows).

    A chunk goes to the rank that reads the most of its bytes; among equals, to one chosen by
    ``salt`` (the box id) and the chunk, so that boxes read whole by every rank (replicated
    tensors) spread over the ranks; a chunk nobody reads goes round-robin. The reader
    boundaries cut the chunks into segments over which the readers that cover them whole do not
    change; only the chunks that a boundary falls inside are looked at one by one."""
    n = -(-rows // size)

    def pick(candidates: list[int], at: int) -> int:
        return sorted(candidates)[(salt + at) % len(candidates)]

    def round_robin(p: int, q: int) -> list[tuple[int, int]]:
        first = p + (rank - salt - p) % world
        return [(i, i + 1) for i in range(first, q, world)]

    full = [(-(-lo // size), n if hi >= rows else hi // size, r, per_row) for r, lo, hi, per_row in readers]
    inside = {lo // size for _, lo, _, _ in readers if lo % size} | {
        hi // size for _, _, hi, _ in readers if hi < rows and hi % size}
    cuts = {0, n} | {a for a, _, _, _ in full} | {max(a, b) for a, b, _, _ in full} | inside | {c + 1 for c in inside}
    points = sorted(c for c in cuts if 0 <= c <= n)
    out: list[tuple[int, int]] = []
    for p, q in zip(points, points[1:]):
        if p in inside:  # a reader boundary falls inside chunk p (q == p + 1)
            lo_c, hi_c = p * size, min(q * size, rows)
            want: dict[int, int] = defaultdict(int)
            for r, lo, hi, per_row in readers:
                if min(hi, hi_c) > max(lo, lo_c):
                    want[r] += (min(hi, hi_c) - max(lo, lo_c)) * per_row
            if not want:
                out += round_robin(p, q)
                continue
            best = max(want.values())
            owner = pick([r for r, w in want.items() if w == best], p)
        else:
            cover = [(per_row, r) for a, b, r, per_row in full if a <= p and q <= b]
            if not cover:
                out += round_robin(p, q)
                continue
            best = max(per_row for per_row, _ in cover)
            owner = pick(list({r for per_row, r in cover if per_row == best}), p)
        if owner == rank:
            out.append((p, q))
    return out
