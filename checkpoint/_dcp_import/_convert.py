"""`import_dcp`: a torch DCP checkpoint directory to a verified shardwise checkpoint.

[Note: the steps of an import]
1. Read ``.metadata`` without running code from it (``_metadata.read_dcp_metadata``).
2. Check the source before writing: every ``.distcp`` file exists and holds its byte ranges;
   every tensor's chunks tile it (``_geometry.tiling_problem``); every chunk's record is a tensor
   of the right dtype and shape (``_records.tensor_record``, reading only the ZIP directory and
   small pickle); every other entry is a plain value. Keys become shardwise's (``_keys``).
3. Write one ``rank-<i>.safetensors`` per source file with ``_format.StreamingWriter``, copying
   each chunk's bytes straight from the source in slabs of at most ``chunk_bytes`` through one
   buffer (``ImportStats.largest_buffer_bytes``). Where torch recorded the ZIP CRC-32 of a storage
   that is exactly the chunk, the box's CRC must equal it, so damage is caught, not copied.
4. ``index.json`` last, the directory committed atomically ([Note: atomic commit] in
   ``checkpoint/_series/_commit.py``, via ``_offline``'s temporary directory), then verified.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .._series import delete_own_files
from .._base import CheckpointError
from .._format import (DTYPE_CODES, FORMAT_NAME, INDEX_FILE, Index, SavedBox, StreamingWriter, TensorEntry,
                       data_file_name, format_index, index_to_json, pread_into)
from .._geometry import Box, tiling_problem
from .._offline import Progress as _Progress, into_place as _into_place, verify_checkpoint
from .._storage import PosixStorage, ReadHandle, storage_for
from ._keys import shardwise_keys
from ._metadata import DcpCheckpoint, DcpChunk, METADATA_FILE, read_dcp_metadata
from ._records import TensorRecord, tensor_record, value_record
from ._source import open_files as _open_files, rank_of as _rank_of, source_dir as _source_dir

__all__ = ["ImportStats", "import_dcp"]


@dataclass(frozen=True)
class ImportStats:
    """What `import_dcp` did. ``largest_buffer_bytes``: the largest buffer it allocated for
    tensor data (one slab; see [Note: the steps of an import])."""

    tensors: int
    boxes: int
    values: int
    bytes_copied: int
    largest_buffer_bytes: int
    files: int
    source_world_size: int


_Part = tuple[str, torch.dtype, Box, Callable[[StreamingWriter, str], None]]  # key, dtype, box, its copier


def _layout(chunks: tuple[DcpChunk, ...], ndim: int) -> dict | None:
    """Informational (the boxes say where everything is): the grid the chunks form, as one
    ``Shard(dim=d)`` axis per split dimension."""
    if len(chunks) <= 1:
        return None
    split = [(d, len({c.offsets[d] for c in chunks})) for d in range(ndim)]
    split = [(d, n) for d, n in split if n > 1]
    return {"mesh_shape": [n for _, n in split], "mesh_dim_names": None,
            "placements": [f"Shard(dim={d})" for d, _ in split]}


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for s, st in zip(reversed(shape), reversed(stride)):
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


class _Copier:
    """Copies saved chunks into a `StreamingWriter` through one reused buffer."""

    def __init__(self, chunk_bytes: int, progress: _Progress) -> None:
        self.chunk_bytes, self.progress = chunk_bytes, progress
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.largest = self.copied = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.buf.numel():
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            self.largest = max(self.largest, nbytes)
        return self.buf[:nbytes]

    def copy(self, h: ReadHandle, rec: TensorRecord, writer: StreamingWriter, where: str) -> None:
        shape, item = rec.shape, rec.dtype.itemsize
        rows = shape[0] if shape else 1
        row = item
        for s in shape[1:]:
            row *= s
        if rows * row == 0:
            return
        step = max(1, min(rows, self.chunk_bytes // row))
        if _row_major(shape, rec.stride):
            start = rec.data.start + rec.storage_offset * item
            for r in range(0, rows, step):
                n = min(step, rows - r)
                buf = self._buffer(n * row)
                pread_into(h, buf, start + r * row, where)
                writer.append(buf.view(rec.dtype).view((n, *shape[1:]) if shape else ()))
                self.progress.add(n * row)
            self.copied += rows * row
            return
        # strided record (a non-contiguous tensor saved whole): read the span it covers, copy rows out
        last = rec.storage_offset + sum((s - 1) * st for s, st in zip(shape, rec.stride))
        span = self._buffer((last + 1) * item)
        pread_into(h, span, rec.data.start, where)
        full = torch.as_strided(span.view(rec.dtype), shape, rec.stride, rec.storage_offset)
        self.largest = max(self.largest, span.numel() + step * row)  # plus the writer's contiguous copy
        for r in range(0, rows, step):
            writer.append(full[r: r + step] if shape else full)
            self.progress.add(min(step, rows - r) * row)
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.copied += rows * row


def _check_chunk(key: str, c: DcpChunk, rec: TensorRecord, dtype: torch.dtype, where: str) -> None:
    if rec.dtype != dtype or rec.shape != c.sizes:
        raise CheckpointError(f"{where}: tensor '{key}' chunk at {list(c.offsets)} is saved as {rec.dtype} "
                              f"{list(rec.shape)}, but the metadata says {dtype} {list(c.sizes)}; the checkpoint is "
                              "damaged")


def import_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, replace: bool = False, chunk_bytes: int = 64 << 20,
               progress: bool = False) -> ImportStats:
    """Convert the torch DCP checkpoint ``src`` (local or fsspec) into a new local shardwise
    checkpoint ``dst`` ([Note: the steps of an import]); one process. Returns what it did.

    Every tensor keeps its dtype and global shape, each chunk one saved box; other entries become
    plain values, under the keys ``save`` would give. ``dst`` must not exist (or be empty) unless
    ``replace=True``. Raises a one-line `CheckpointError`, and then nothing is written."""
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    storage, path = storage_for(src)
    where_src = storage.url(path)
    listed = _source_dir(storage, path, where_src)
    dcp = read_dcp_metadata(storage, path)
    handles = _open_files(storage, path, dcp, where_src)
    ranks = {_rank_of(n) for n in listed if n.endswith(".distcp")} - {None}
    try:
        return _import(storage, path, dcp, handles, os.path.abspath(os.fspath(dst)), replace, chunk_bytes, progress,
                       len(ranks) or len(handles))
    finally:
        for h in handles.values():
            h.close()


def _import(storage, path: str, dcp: DcpCheckpoint, handles: dict[str, ReadHandle], out: str, replace: bool,
            chunk_bytes: int, progress: bool, world: int) -> ImportStats:
    url = lambda name: storage.url(storage.join(path, name))  # noqa: E731
    values = {k: value_record(handles[v.file], v.offset, v.length, f"{url(v.file)}: entry '{k}'")
              for k, v in dcp.values.items()}
    records: dict[tuple[str, tuple[int, ...]], TensorRecord] = {}
    for key, t in dcp.tensors.items():
        if t.dtype not in DTYPE_CODES:
            raise CheckpointError(f"tensor '{key}' has dtype {t.dtype}, which safetensors cannot store")
        problem = tiling_problem(t.shape, [Box(c.offsets, c.sizes) for c in t.chunks])
        if problem:
            raise CheckpointError(f"{url(METADATA_FILE)}: the chunks of tensor '{key}' do not tile it: {problem}")
        for c in t.chunks:
            where = f"{url(c.file)}: tensor '{key}' chunk at {list(c.offsets)}"
            rec = records[(key, c.offsets)] = tensor_record(handles[c.file], c.offset, c.length, where)
            _check_chunk(key, c, rec, t.dtype, url(c.file))
    names, plain, embedded = shardwise_keys(dcp.paths, {k: (t.dtype, t.shape) for k, t in dcp.tensors.items()},
                                            values)
    for key, e in embedded.items():
        if e.dtype not in DTYPE_CODES:
            raise CheckpointError(f"tensor '{key}' has dtype {e.dtype}, which safetensors cannot store")
    sources = sorted({c.file for t in dcp.tensors.values() for c in t.chunks},
                     key=lambda n: (_rank_of(n) is None, _rank_of(n) or 0, n))
    total = sum(t.dtype.itemsize * Box(c.offsets, c.sizes).numel for t in dcp.tensors.values() for c in t.chunks)
    copier = _Copier(chunk_bytes, _Progress("import-dcp", total, progress))
    # output file i holds the chunks of source file i; file 0 also the tensors found inside values
    files: list[dict[str, _Part]] = []
    outputs: list[str | None] = [*sources] or ([None] if embedded else [])
    for source in outputs:
        parts: dict[str, _Part] = {}
        for k, t in dcp.tensors.items():
            for c in t.chunks:
                if c.file == source:
                    parts[f"{names[k]}@{','.join(map(str, c.offsets))}"] = (
                        names[k], t.dtype, Box(c.offsets, c.sizes), partial(_copy_chunk, copier, handles[c.file],
                                                                            records[(k, c.offsets)], k, c, url(c.file)))
        files.append(parts)
    for key, e in embedded.items():
        if e.numel():
            files[0][f"{key}@{','.join('0' * e.dim())}"] = (key, e.dtype, Box((0,) * e.dim(), tuple(e.shape)),
                                                            partial(_append, e))
    boxes: dict[str, list[SavedBox]] = {names[k]: [] for k in dcp.tensors}
    boxes.update({k: [] for k in embedded})

    def fill(tmp: str) -> None:
        sizes: dict[str, int | None] = {}
        for i, parts in enumerate(files):
            name = data_file_name(i)
            writer = StreamingWriter(os.path.join(tmp, name), [(fk, p[1], p[2].sizes) for fk, p in parts.items()],
                                     {"format": FORMAT_NAME, "rank": str(i)})
            try:
                for fk in writer.keys:
                    parts[fk][3](writer, fk)
            except BaseException:
                writer.abort()
                raise
            sums = writer.close()
            sizes[name] = os.path.getsize(os.path.join(tmp, name))
            for fk, (key, _, box, _) in parts.items():
                s = sums[fk]
                boxes[key].append(SavedBox(box, name, fk, s.crc32, s.chunk_rows, s.chunk_crc32))
        tensors = {names[k]: TensorEntry(t.dtype, t.shape, tuple(boxes[names[k]]), _layout(t.chunks, len(t.shape)))
                   for k, t in dcp.tensors.items()}
        tensors.update({k: TensorEntry(e.dtype, tuple(e.shape), tuple(boxes[k])) for k, e in embedded.items()})
        index = Index(tensors, plain, sizes, world, time.time_ns(), save_id=os.path.basename(tmp).rsplit("-", 1)[-1])
        PosixStorage().write_atomic(os.path.join(tmp, INDEX_FILE), format_index(index_to_json(index)).encode())

    _into_place(path, out, fill, replace)
    report = verify_checkpoint(out)
    if not report.fully_checked:
        delete_own_files(PosixStorage(), out)
        raise CheckpointError(f"the imported checkpoint {out} failed verification, so it was removed: "
                              f"{(report.problems or report.unchecked)[0]}")
    return ImportStats(len(boxes), sum(map(len, boxes.values())), len(plain), copier.copied, copier.largest,
                       len(files), world)


def _append(t: torch.Tensor, writer: StreamingWriter, fk: str) -> None:
    writer.append(t)


def _copy_chunk(copier: _Copier, h: ReadHandle, rec: TensorRecord, key: str, c: DcpChunk, where: str,
                writer: StreamingWriter, fk: str) -> None:
    copier.copy(h, rec, writer, f"{where}: tensor '{key}'")
    _check_crc(rec, writer, fk, key, c, where)


def _check_crc(rec: TensorRecord, writer: StreamingWriter, fk: str, key: str, c: DcpChunk, where: str) -> None:
    """The box's CRC-32 against torch's ZIP CRC-32 of the storage, when the storage is exactly
    the box's bytes (and torch recorded one)."""
    got = writer.checksums.get(fk)
    nbytes = Box(c.offsets, c.sizes).numel * rec.dtype.itemsize
    if (got is not None and rec.data.crc32 is not None and rec.storage_offset == 0 and rec.data.size == nbytes
            and _row_major(rec.shape, rec.stride) and got.crc32 != rec.data.crc32):
        raise CheckpointError(f"{where}: tensor '{key}' chunk at {list(c.offsets)}: checksum mismatch against the "
                              "CRC-32 torch.save recorded (the DCP file is corrupted); nothing was written")
