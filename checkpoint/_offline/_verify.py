"""``verify_checkpoint``: check a checkpoint completely, without torch.distributed.

Collecting every problem: the index (``_format.read_index``); every tensor's boxes tile it
(``_tiling.tiling_problem``; exact duplicates accepted); every data file exists with its recorded
size and a parseable header; every box is in its file with the right dtype and shape, and its
CRC-32 matches (4 MiB reads; per chunk for boxes with [Note: checksum chunks] in
``checkpoint/_base/_checksums.py``, whose CRCs must combine into the box's). What cannot be
checked (a box or an index without a checksum) goes to ``VerifyReport.unchecked``;
``fully_checked`` means no problem and nothing unchecked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._base import CheckpointError, box_rows, combine_chunks
from .._format import CheckpointFiles, SavedBox, crcs_of_range, open_checkpoint
from .._geometry import saved_tiling_problem
from .._storage import Storage

__all__ = ["VerifyReport", "file_problems", "verify_checkpoint"]


def file_problems(files: CheckpointFiles, checksums: bool) -> tuple[list[str], int, int]:
    """``(problems, boxes, bytes checksummed)`` of ``files``'s data files, boxes and tilings; with
    ``checksums`` every box's CRC-32s too (``verify``; ``inspect`` reports a box without a
    checksum instead)."""
    index, problems = files.index, []
    bad: set[str] = set()
    names = set(index.files) | {b.file for t in index.tensors.values() for b in t.boxes}
    for name in sorted(names):
        if name not in index.files:
            problems.append(f"data file {files.url(name)} is used by boxes but not listed in the index")
        try:
            files.header(name)
        except CheckpointError as e:
            problems.append(str(e))
            bad.add(name)
    nboxes = checked = 0
    index_file = files.url("index.json")
    for key, t in index.tensors.items():
        gap = saved_tiling_problem(t.shape, [b.box for b in t.boxes])
        if gap:
            problems.append(f"{index_file}: tensor '{key}': {gap}")
        for b in t.boxes:
            nboxes += 1
            where = f"data file {files.url(b.file)}: tensor '{key}' box at {list(b.box.offsets)} (key '{b.key}')"
            if b.file not in bad:
                problem = files.box_problem(key, b)
                if problem:
                    problems.append(problem)
                    continue
            if not checksums:
                if b.crc32 is None and b.chunk_crc32 is None:
                    problems.append(f"{where}: the index records no checksum for it (crc32 null), which shardwise "
                                    "never writes")
                continue
            if b.file in bad:
                continue
            if b.crc32 is not None or b.chunk_crc32 is not None:
                entry = files.header(b.file).entries[b.key]
                checked += entry.end - entry.begin
                problems += [f"{where}: {p}" for p in _check_box(files, b, t.dtype.itemsize)]
    return problems, nboxes, checked


@dataclass(frozen=True)
class VerifyReport:
    """``problems`` is empty when the checkpoint is sound."""

    path: str
    problems: tuple[str, ...]
    tensors: int = 0
    boxes: int = 0
    bytes_checked: int = 0
    unchecked: tuple[str, ...] = ()  # what could not be checked (no checksum recorded for it)

    @property
    def ok(self) -> bool:
        """No problem found. Check ``unchecked`` too: see ``fully_checked``."""
        return not self.problems

    @property
    def fully_checked(self) -> bool:
        """No problem found and everything checked (every box and the index had a checksum)."""
        return not self.problems and not self.unchecked


def verify_checkpoint(path: str | os.PathLike, *, storage: Storage | None = None) -> VerifyReport:
    """Check the checkpoint at ``path`` (a path or an fsspec URL; see the module docstring)."""
    try:
        files = open_checkpoint(path, storage)
    except CheckpointError as e:
        return VerifyReport(str(os.fspath(path)) if "://" in os.fspath(path) else os.path.abspath(os.fspath(path)),
                            (str(e),))
    with files:
        index = files.index
        unchecked: list[str] = []
        if not index.checksummed:
            unchecked.append(f"{files.url('index.json')}: the index has no checksum of its own (written by an older "
                             "shardwise), so its plain values and box list could not be checked")
        problems, nboxes, checked = file_problems(files, checksums=True)
        for key, t in index.tensors.items():
            for b in t.boxes:
                if b.crc32 is None and b.chunk_crc32 is None and b.box.numel:
                    unchecked.append(f"data file {files.url(b.file)}: tensor '{key}' box at {list(b.box.offsets)} (key "
                                     f"'{b.key}'): not checked: the index records no checksum for it (crc32 null)")
        return VerifyReport(files.where, tuple(problems), len(index.tensors), nboxes, checked, tuple(unchecked))


def _check_box(files: CheckpointFiles, b: SavedBox, itemsize: int) -> list[str]:
    """The checksum problems of saved box ``b`` (its header entry already checked)."""
    header = files.header(b.file)
    e = header.entries[b.key]
    row_bytes = box_rows(b.box.sizes)[1] * itemsize
    chunk_bytes = b.chunk_rows * row_bytes if b.chunk_crc32 is not None and b.chunk_rows else None
    h = files.handle(b.file)
    try:
        crc = crcs_of_range(h, header.data_start + e.begin, header.data_start + e.end, h.name, chunk_bytes)
    except CheckpointError as err:
        return [str(err)]
    if b.chunk_crc32 is None:
        return [] if crc.whole() == b.crc32 else ["checksum mismatch (the data is corrupted)"]
    problems = []
    assert b.chunk_rows is not None and chunk_bytes is not None
    first = b.box.offsets[0] if b.box.offsets else 0
    for i, (got, want) in enumerate(zip(crc.chunks(), b.chunk_crc32)):
        if got != want:
            lo, hi = i * b.chunk_rows, min((i + 1) * b.chunk_rows, box_rows(b.box.sizes)[0])
            problems.append(f"checksum mismatch in chunk {i}: rows [{lo}, {hi}) of the box, rows "
                            f"[{first + lo}, {first + hi}) of the tensor (the data is corrupted)")
    if b.crc32 is not None and combine_chunks(b.chunk_crc32, chunk_bytes, e.end - e.begin) != b.crc32:
        problems.append("the index's chunk checksums do not combine into its checksum of the box (the index is "
                        "damaged)")
    return problems
