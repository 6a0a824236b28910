"""Load-time verification planning: which rank checks which checksum unit.

[Note: verification shares]
With ``verify`` every checksum *unit* of the loaded tensors (a chunk, or a whole box without
chunks) is checked by exactly one rank, before any rank writes. Each rank gathers to rank 0 the
tensors it loads (a bit mask over the index's sorted keys, `keys_to_mask`) and the dim-0 row
ranges it reads from every saved box (`needs_of`, boxes numbered by `box_ids`, from the index
alone); the units are those of the union of the sets (ranks may load different tensors).
Rank 0 works out every share in one pass (`all_shares`) and scatters each rank its own
(``[box id, first chunk, end chunk]`` ranges, `units_of`): a unit goes to the rank that reads
most of its bytes anyway; among equals to one picked by box and chunk, so replicated boxes
spread over the ranks; a unit nobody reads round-robin. A rank thus re-reads only the parts of
chunks straddling its shard's boundaries. The work is per saved box and reader boundary
(`chunk_owners`); `share_of` is one rank's share, the same as `all_shares` gives it.

Both messages are packed (`pack_ints`: box ids as differences, then zlib): a regular layout
repeats one pattern, so a rank's message stays a few hundred bytes (the plain lists were 13 KiB
a rank for 1,000 tensors; ``benchmarks/checkpoint_scale.py``). Checksums are in ``_checksums.py``.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._geometry import Box
from .._base import box_rows
from .._format import Index, SavedBox

__all__ = ["Unit", "all_shares", "pack_ints", "unpack_ints", "box_ids", "chunk_owners", "contiguous_runs", "id_boxes", "keys_to_mask", "mask_to_keys", "needs_of",
           "owned_chunks", "share_of", "units_of"]


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
        crc = self.saved.crc32 if self.chunk is None else self.saved.chunk_crc32[self.chunk]  # type: ignore[index]
        assert crc is not None, "units are made only of boxes with a checksum"
        return crc

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
    """The set ``keys`` of tensor keys as a bit mask over the sorted keys of the index, zlib
    compressed, base64 (a few bytes when a rank loads every tensor, as usual)."""
    pos = {k: i for i, k in enumerate(sorted(index.tensors))}
    mask = 0
    for k in keys:
        mask |= 1 << pos[k]
    return base64.b64encode(zlib.compress(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), 6)).decode()


def mask_to_keys(index: Index, masks: Iterable[str]) -> list[str]:
    """The union of the key sets ``masks`` (from `keys_to_mask`), in sorted order."""
    union = 0
    for m in masks:
        union |= int.from_bytes(zlib.decompress(base64.b64decode(m)), "little")
    return [k for i, k in enumerate(sorted(index.tensors)) if union >> i & 1]


def pack_ints(values: Sequence[int], width: int) -> str:
    """``values``, records of ``width`` ints whose first is a box id, as compact text: the box
    ids as differences from the previous record's, JSON, zlib, base64 ([Note: verification shares])."""
    out, prev = list(values), 0
    for j in range(0, len(out), width):
        out[j], prev = out[j] - prev, out[j]
    return base64.b64encode(zlib.compress(json.dumps(out, separators=(",", ":")).encode(), 6)).decode()


def unpack_ints(text: str, width: int) -> list[int]:
    """The inverse of `pack_ints`."""
    out = json.loads(zlib.decompress(base64.b64decode(text)))
    if not isinstance(out, list) or len(out) % width or not all(isinstance(v, int) for v in out):
        raise ValueError(f"a packed list of records of {width} integers was expected")
    prev = 0
    for j in range(0, len(out), width):
        out[j] = prev = prev + out[j]
    return out


def needs_of(reads: Iterable[tuple[str, str, Box, int]], ids: dict[tuple[str, str], int]) -> list[int]:
    """What this rank reads, for rank 0: ``[box id, first row, end row, bytes per row]`` for each
    ``(file, key, region of the saved box, itemsize)`` in ``reads``, in box id order (which packs
    small: `pack_ints`), flattened."""
    records: list[tuple[int, int, int, int]] = []
    for file, key, src, itemsize in reads:
        bid = ids.get((file, key))
        if bid is None:
            continue
        rows, per_row = box_rows(src.sizes)
        lo = src.offsets[0] if src.sizes else 0
        records.append((bid, lo, lo + rows, per_row * itemsize))
    return [v for rec in sorted(records) for v in rec]


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
    wants = _wants(needs)
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
            size = b.chunk_rows if chunked and b.chunk_rows else rows
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
    row)]`` (a rank may appear several times, for disjoint rows): those of `chunk_owners` that
    are ``rank``'s."""
    return [(p, q) for p, q, owner in chunk_owners(readers, rows, size, salt, world, rank) if owner == rank]


def chunk_owners(readers: Sequence[tuple[int, int, int, int]], rows: int, size: int, salt: int, world: int,
                 only: int | None = None) -> list[tuple[int, int, int]]:
    """Who checks each chunk of a box (see `owned_chunks` for the arguments): ``(p, q, owner)``
    for ranges of chunk indices ``[p, q)``; ``only``: a rank whose chunks alone are wanted
    (the round-robin of unread chunks then lists only its chunks).

    A chunk goes to the rank that reads the most of its bytes; among equals, to one chosen by
    ``salt`` (the box id) and the chunk, so that boxes read whole by every rank (replicated
    tensors) spread over the ranks; a chunk nobody reads goes round-robin (chunk ``i`` to rank
    ``(i + salt) % world``). The reader boundaries cut the chunks into segments over which the
    readers that cover them whole do not change; only the chunks that a boundary falls inside
    are looked at one by one."""
    n = -(-rows // size)

    def pick(candidates: list[int], at: int) -> int:
        return sorted(candidates)[(salt + at) % len(candidates)]

    def round_robin(p: int, q: int) -> list[tuple[int, int, int]]:
        if only is not None:
            first = p + (only - salt - p) % world
            return [(i, i + 1, only) for i in range(first, q, world)]
        return [(i, i + 1, (i + salt) % world) for i in range(p, q)]

    full = [(-(-lo // size), n if hi >= rows else hi // size, r, per_row) for r, lo, hi, per_row in readers]
    inside = {lo // size for _, lo, _, _ in readers if lo % size} | {
        hi // size for _, _, hi, _ in readers if hi < rows and hi % size}
    cuts = {0, n} | {a for a, _, _, _ in full} | {max(a, b) for a, b, _, _ in full} | inside | {c + 1 for c in inside}
    points = sorted(c for c in cuts if 0 <= c <= n)
    out: list[tuple[int, int, int]] = []
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
        out.append((p, q, owner))
    return out


def _units(index: Index, ids: dict[tuple[str, str], int], keys: Iterable[str]):
    """For each checkable saved box of the tensors ``keys``: ``(tensor key, box, box id, rows,
    bytes per row, chunk rows)``."""
    for k in sorted(set(keys)):
        t = index.tensors[k]
        for b in t.boxes:
            rows, per_row = box_rows(b.box.sizes)
            row_bytes = per_row * t.dtype.itemsize
            chunked = b.chunk_crc32 is not None
            if rows * row_bytes == 0 or (not chunked and b.crc32 is None):
                continue  # no bytes, or no checksum
            yield k, b, ids[(b.file, b.key)], rows, row_bytes, (b.chunk_rows if chunked and b.chunk_rows else rows)


def _wants(needs: Sequence[Sequence[int]]) -> dict[int, list[tuple[int, int, int, int]]]:
    wants: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for r, flat in enumerate(needs):
        for j in range(0, len(flat), 4):
            bid, lo, hi, per_row = flat[j:j + 4]
            if hi > lo:
                wants[bid].append((r, lo, hi, per_row))
    return wants


def all_shares(index: Index, keys: Iterable[str], ids: dict[tuple[str, str], int], needs: Sequence[Sequence[int]],
               world: int) -> list[list[int]]:
    """Every rank's share at once (rank 0 works it out for the world, [Note: verification
    shares]): for each rank, ``[box id, first chunk, end chunk, ...]`` flattened, the same
    units as `share_of` gives that rank. One pass over the boxes of ``keys`` and the needs."""
    wants = _wants(needs)
    out: list[list[int]] = [[] for _ in range(world)]
    for _, _, bid, rows, _, size in _units(index, ids, keys):
        for p, q, owner in chunk_owners(wants.get(bid, ()), rows, size, bid, world):
            share = out[owner]
            if share and share[-3] == bid and share[-1] == p:
                share[-1] = q  # consecutive ranges of one box: one entry
            else:
                share += [bid, p, q]
    return out


def id_boxes(index: Index) -> list[tuple[str, SavedBox]]:
    """``(tensor key, saved box)`` by box id (`box_ids`' numbering)."""
    out: list[tuple[str, SavedBox]] = []
    seen: set[tuple[str, str]] = set()
    for k in sorted(index.tensors):
        for b in index.tensors[k].boxes:
            if (b.file, b.key) not in seen:
                seen.add((b.file, b.key))
                out.append((k, b))
    return out


def units_of(index: Index, boxes: Sequence[tuple[str, SavedBox]], share: Sequence[int]) -> list[Unit]:
    """The `Unit` s of a share from `all_shares` (``[box id, first chunk, end chunk, ...]``);
    ``boxes`` is `id_boxes` of the index. The work is per unit of the share."""
    mine: list[Unit] = []
    for j in range(0, len(share), 3):
        bid, p, q = share[j:j + 3]
        k, b = boxes[bid]
        rows, per_row = box_rows(b.box.sizes)
        row_bytes = per_row * index.tensors[k].dtype.itemsize
        chunked = b.chunk_crc32 is not None
        size = b.chunk_rows if chunked and b.chunk_rows else rows
        mine += [Unit(k, b, bid, i if chunked else None, i * size, min((i + 1) * size, rows), row_bytes)
                 for i in range(p, q)]
    return mine
