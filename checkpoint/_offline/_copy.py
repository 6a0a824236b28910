"""The copying machinery of the offline tools (``merge``, ``reshard``, ``import-dcp``): the
source verified first, regions of its tensors read through safetensors slices, written one
slab of dim-0 rows at a time into a checksummed safetensors file, with a progress bar, into a
temporary directory renamed into place ([Note: atomic commit] in ``checkpoint/_series/_commit.py``). What goes
into which output file is the caller's (``_offline.py``, ``_dcp_import/_convert.py``)."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable

import torch

from .._base import BoxChecksums, CheckpointError
from .._series import commit, is_checkpoint, own_files, remove_temp, temp_dir_for
from .._format import CheckpointFiles, StreamingWriter, open_checkpoint
from .._geometry import Box, LocalBox, distinct_boxes, plan_reads
from .._load import read_region
from .._storage import PosixStorage, Storage
from ._verify import verify_checkpoint

__all__ = ["Progress", "Source", "slabs", "write_file", "verified", "refuse_target", "into_place"]


class Progress:
    """A one-line progress bar on stderr (bytes done of a total), at most 10 updates a second."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done, self.enabled, self._last = label, max(total, 1), 0, enabled, 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {self.done / 1e6:.1f}/"
                             f"{self.total / 1e6:.1f} MB")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class Source:
    """Reads regions of a checkpoint's tensors from its files (opened once each, by ``files``)."""

    def __init__(self, files: CheckpointFiles) -> None:
        self.files, self.index = files, files.index

    def read(self, key: str, box: Box) -> torch.Tensor:
        entry = self.index.tensors[key]
        saved = [entry.boxes[i] for i in distinct_boxes([b.box for b in entry.boxes])]
        items = plan_reads(LocalBox(box, (0,) * len(box.sizes)), [b.box for b in saved])
        if sum(it.src.numel for it in items) != box.numel:
            raise CheckpointError(f"checkpoint {self.files.where} lacks part of tensor '{key}' (box at "
                                  f"{list(box.offsets)} of size {list(box.sizes)}); run verify")
        out = torch.empty(box.sizes, dtype=entry.dtype)
        for it in items:
            read_region(self.files, saved[it.source], it.src, out[it.dst.slices()])
        return out


def slabs(box: Box, itemsize: int, chunk_bytes: int) -> list[Box]:
    if not box.sizes or box.numel == 0:
        return [box] if box.numel else []
    row = box.numel // box.sizes[0] * itemsize
    step = max(1, chunk_bytes // max(row, 1))
    return [Box((box.offsets[0] + s, *box.offsets[1:]), (min(step, box.sizes[0] - s), *box.sizes[1:]))
            for s in range(0, box.sizes[0], step)]


def write_file(path: str, source: Source, parts: list[tuple], chunk_bytes: int, progress: Progress,
           metadata: dict[str, str]) -> dict[str, BoxChecksums]:
    """Write ``parts`` ``[(file_key, tensor key, global box[, shape])]`` into one safetensors
    file (``shape``: the written tensor's, default the box's sizes; an expert's ``[1, h, d]``
    box is written ``[h, d]``)."""
    by_key = {part[0]: (part[1], part[2], part[3] if len(part) > 3 else part[2].sizes) for part in parts}
    writer = StreamingWriter(path, [(fk, source.index.tensors[k].dtype, shape) for fk, (k, _, shape) in by_key.items()],
                             metadata)
    try:
        for fk in writer.keys:
            key, box, _ = by_key[fk]
            itemsize = torch.empty((), dtype=source.index.tensors[key].dtype).element_size()
            for slab in slabs(box, itemsize, chunk_bytes):
                writer.append(source.read(key, slab))
                progress.add(slab.numel * itemsize)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def verified(path: str | os.PathLike) -> CheckpointFiles:
    """The index of the checkpoint at ``path`` once `verify_checkpoint` found it sound and fully
    checked, so damage is never copied under fresh checksums (an index without its own checksum is
    accepted, a box without one is not)."""
    path = os.fspath(path)
    path = path if "://" in path else os.path.abspath(path)  # a URL (s3://...) is read through fsspec
    report = verify_checkpoint(path)
    if report.problems:
        more = f" (and {len(report.problems) - 1} more problems; run verify)" if len(report.problems) > 1 else ""
        raise CheckpointError(f"{report.problems[0]}{more}; nothing was written")
    boxes = [u for u in report.unchecked if "crc32 null" in u]
    if boxes:
        raise CheckpointError(f"{boxes[0]}; refusing to copy data that cannot be checked, nothing was written")
    return open_checkpoint(path)


def refuse_target(source: str, out: str, replace: bool, replaceable: Callable[[Storage, str], bool],
                   what: str) -> None:
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise CheckpointError(f"{out} is the source checkpoint {source}, inside it or contains it; write to another "
                              "path (it is never replaced)")
    if not os.path.lexists(out) or (os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)):
        return
    if not replace:
        raise CheckpointError(f"{out} already exists; refusing to write over it. Choose a new path, or pass "
                              "replace=True (--replace) to replace an existing " + what)
    if os.path.islink(out) or not replaceable(PosixStorage(), out):
        raise CheckpointError(f"{out} exists and is not {what}; refusing to replace it even with --replace")


def into_place(source: str, out: str, fill: Callable[[str], None], replace: bool,
                replaceable: Callable[[Storage, str], bool] = is_checkpoint,
                own: Callable[[Storage, str], set[str]] = own_files, what: str = "shardwise checkpoint") -> None:
    out = os.fspath(out)
    if "://" in out:
        raise CheckpointError(f"{out}: the offline tools write into a local folder, not to a URL; write to a local "
                              "path and upload that folder (the source may be a URL)")
    out = os.path.abspath(out)
    refuse_target(source, out, replace, replaceable, what)
    token = secrets.token_hex(4)
    storage = PosixStorage()
    tmp = temp_dir_for(storage, out, token)
    os.makedirs(tmp)
    try:
        fill(tmp)
        commit(storage, tmp, out, token, replaceable=replaceable, own=own)
    except BaseException:
        remove_temp(storage, tmp)  # a failed merge or reshard leaves nothing behind
        raise
