"""``verify_checkpoint``: check a checkpoint completely, without torch.distributed.

Checks, in order, collecting every problem rather than stopping at the first:

1. the directory is a complete checkpoint of a known version (``_format.read_index``);
2. every tensor's saved boxes lie inside it, are disjoint and cover it (``_tiling.tiling_problem``;
   exact duplicates, which saves before the one-writer fix wrote, are accepted and all checked);
3. every data file the index names exists and has the recorded size, and its safetensors
   header parses (a truncated file is reported as such);
4. every saved box's key is in its file with the tensor's dtype and the box's shape, and the
   CRC-32 of its bytes matches the index (read 4 MiB at a time); for a box with checksum
   chunks ([Note: checksum chunks] in ``_checksums.py``) the CRC-32 of every chunk matches
   (a mismatch names the chunk's rows), and the chunk CRCs combine into the box's CRC (else
   the index is inconsistent). The chunk layout itself (the number of chunk CRCs against the
   box's rows) is checked when the index is read.

What cannot be checked is listed in ``VerifyReport.unchecked`` rather than passed as OK: a
box whose index entry has no checksum (``crc32: null``), an index without its own checksum
(written before indexes had one). ``fully_checked`` is true only when there is neither a
problem nor anything unchecked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._checksums import box_rows, combine_chunks
from ._errors import CheckpointError
from ._file_io import crcs_of_range, data_file_size, open_for_ranges
from ._format import SavedBox, read_index
from ._safetensors_io import DTYPE_CODES, Header, read_header
from ._tiling import saved_tiling_problem

__all__ = ["VerifyReport", "data_file_size_problem", "verify_checkpoint"]


def data_file_size_problem(file: str, expected: int | None) -> str | None:
    """None when the data file ``file`` (of a shardwise checkpoint: a regular file, not a
    symbolic link) has ``expected`` bytes (None: any), else the sentence saying it has not;
    a `CheckpointError` when it is missing or not a regular file."""
    size = data_file_size(file, follow=False)
    if expected is not None and size != expected:
        return f"data file {file} has {size} bytes, the index records {expected} (truncated?)"
    return None


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


def verify_checkpoint(path: str | os.PathLike) -> VerifyReport:
    """Check the checkpoint at ``path`` (see the module docstring)."""
    path = os.path.abspath(os.fspath(path))
    try:
        index = read_index(path)
    except CheckpointError as e:
        return VerifyReport(path, (str(e),))
    problems: list[str] = []
    unchecked: list[str] = []
    if not index.checksummed:
        unchecked.append(f"{os.path.join(path, 'index.json')}: the index has no checksum of its own (written by an "
                         "older shardwise), so its plain values and box list could not be checked")
    headers = {}
    names = set(index.files) | {b.file for t in index.tensors.values() for b in t.boxes}
    for name in sorted(names):
        file = os.path.join(path, name)
        expected = index.files.get(name)
        if name not in index.files:
            problems.append(f"data file {file} is used by boxes but not listed in the index")
        try:
            size_problem = data_file_size_problem(file, expected)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if size_problem:
            problems.append(size_problem)
        try:
            headers[name] = read_header(file, follow=False)
        except CheckpointError as e:
            problems.append(str(e))
    nboxes = checked = 0
    for key, t in index.tensors.items():
        gap = saved_tiling_problem(t.shape, [b.box for b in t.boxes])
        if gap:
            problems.append(f"{os.path.join(path, 'index.json')}: tensor '{key}': {gap}")
        for b in t.boxes:
            nboxes += 1
            header = headers.get(b.file)
            if header is None:
                continue
            e = header.entries.get(b.key)
            where = f"data file {os.path.join(path, b.file)}: tensor '{key}' box at {list(b.box.offsets)} (key '{b.key}')"
            if e is None:
                problems.append(f"{where}: the key is not in the file")
            elif e.dtype != DTYPE_CODES[t.dtype] or e.shape != b.box.sizes:
                problems.append(f"{where}: the file holds {e.dtype} {list(e.shape)}, the index says "
                                f"{DTYPE_CODES[t.dtype]} {list(b.box.sizes)}")
            elif b.crc32 is not None or b.chunk_crc32 is not None:
                checked += e.end - e.begin
                problems += [f"{where}: {p}" for p in _check_box(os.path.join(path, b.file), header, b,
                                                                 t.dtype.itemsize)]
            elif b.box.numel:
                unchecked.append(f"{where}: not checked: the index records no checksum for it (crc32 null)")
    return VerifyReport(path, tuple(problems), len(index.tensors), nboxes, checked, tuple(unchecked))


def _check_box(file: str, header: Header, b: SavedBox, itemsize: int) -> list[str]:
    """The checksum problems of saved box ``b`` (its header entry already checked)."""
    e = header.entries[b.key]
    row_bytes = box_rows(b.box.sizes)[1] * itemsize
    chunk_bytes = b.chunk_rows * row_bytes if b.chunk_crc32 is not None else None
    fd = open_for_ranges(file, follow=False)
    try:
        crc = crcs_of_range(fd, header.data_start + e.begin, header.data_start + e.end, file, chunk_bytes)
    except CheckpointError as err:
        return [str(err)]
    finally:
        os.close(fd)
    if b.chunk_crc32 is None:
        return [] if crc.whole() == b.crc32 else ["checksum mismatch (the data is corrupted)"]
    problems = []
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
