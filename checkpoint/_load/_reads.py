"""The byte reads of a load (step 2 of [Note: the steps of a load] in ``_reader.py``).

Reads go through the storage, on the files `CheckpointFiles` opened in step 1: contiguous pieces
straight into their destination (adjacent ones by one request, ``preadv`` on POSIX), column
slices through the dim-0 rows they span (`read_region`, also for ``merge`` and ``reshard``).
Where requests in flight together help (``Storage.read_concurrency`` > 1: an object store) the
reads run on that many threads (`run_bounded`).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from .._format import CheckpointFiles, SavedBox, adjacent_groups, byte_view, contiguous_run, pread_into, preadv_into
from .._geometry import Box, ReadItem, split
from .._storage import ReadHandle

__all__ = ["Read", "read_all", "read_region", "run_bounded"]

T = TypeVar("T")
_PART = 8 << 20  # with concurrent reads, the largest request: a big range goes as several in flight


def run_bounded(tasks: list[Callable[[], T]], workers: int) -> list[T]:
    """The results of ``tasks``, run on at most ``workers`` threads (in this thread when 1); the
    first error is raised once every task has ended."""
    if workers <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(tasks))) as pool:
        futures = [pool.submit(t) for t in tasks]
    return [f.result() for f in futures]


@dataclass
class Read:
    """Fill ``item.dst`` of ``local`` (the target tensor of ``key``) from ``item.src`` of ``saved``."""

    key: str
    local: torch.Tensor
    saved: SavedBox
    item: ReadItem


def _read_rows(h: ReadHandle, at: int, saved: tuple[int, ...], src_offsets: tuple[int, ...],
               src_sizes: tuple[int, ...], dst: torch.Tensor, max_read_bytes: int) -> None:
    """Fill ``dst`` with the region ``src_offsets``/``src_sizes`` of a row-major saved box of shape
    ``saved`` whose bytes start at ``at``, by reading the dim-0 rows the region spans (at most
    ``max_read_bytes`` of them at a time, or one row) and copying the region out of them."""
    itemsize = dst.element_size()
    row_elems = 1
    for n in saved[1:]:
        row_elems *= n
    row_bytes = row_elems * itemsize
    step = max(1, max_read_bytes // max(row_bytes, 1))
    inner = tuple(slice(o, o + n) for o, n in zip(src_offsets[1:], src_sizes[1:]))
    for lo in range(0, src_sizes[0], step):
        rows = min(step, src_sizes[0] - lo)
        buf = torch.empty((rows, *saved[1:]), dtype=dst.dtype)
        pread_into(h, buf, at + (src_offsets[0] + lo) * row_bytes, h.name)
        dst[lo : lo + rows].copy_(buf[(slice(None),) + inner])


def read_region(files: CheckpointFiles, saved: SavedBox, src: Box, out: torch.Tensor,
                max_read_bytes: int = 64 << 20) -> None:
    """Fill ``out`` (a CPU tensor of ``src``'s shape) with the region ``src`` of saved box ``saved``
    (``merge``/``reshard`` read their slabs so)."""
    header = files.header(saved.file)
    h = files.handle(saved.file)
    start = header.data_start + header.entries[saved.key].begin
    run = contiguous_run(src.offsets, src.sizes, saved.box.sizes)
    if run is None:
        _read_rows(h, start, saved.box.sizes, src.offsets, src.sizes, out, max_read_bytes)
    elif out.is_contiguous():
        pread_into(h, out, start + run[0] * out.element_size(), h.name)
    else:
        buf = torch.empty(out.shape, dtype=out.dtype)
        pread_into(h, buf, start + run[0] * out.element_size(), h.name)
        out.copy_(buf)


def read_all(files: CheckpointFiles, reads: list[Read], max_read_bytes: int) -> tuple[int, int]:
    """Step 2 of [Note: the steps of a load]; returns (bytes read, files opened).

    A piece that is one contiguous byte range of its saved box (any dim-0 slab of a saved box,
    as resharding FSDP/HSDP shards gives) is read straight into the destination when that is
    contiguous on the CPU (else into a buffer of the piece's size). Direct pieces whose byte
    ranges follow one another in the file (e.g. consecutive saved boxes that all land in this
    rank's shards) are read by one request (``preadv``) into all their destinations: fewer,
    larger reads. Other pieces (e.g. column slices) read the rows they span (`_read_rows`).
    """
    by_file: dict[str, list[Read]] = defaultdict(list)
    for r in reads:
        by_file[r.saved.file].append(r)
    workers = getattr(files.storage, "read_concurrency", 1)
    part = _PART if workers > 1 else None  # requests in flight together: none larger than this
    nbytes = 0
    tasks: list[Callable[[], None]] = []
    direct_dsts: list[torch.Tensor] = []
    for name, items in by_file.items():
        header = files.header(name)
        h = files.handle(name)
        segments: list[tuple[int, memoryview]] = []  # (file offset, destination bytes)
        for r in items:
            entry = header.entries[r.saved.key]
            itemsize = r.local.element_size()
            for piece in split(r.item, max(1, max_read_bytes // itemsize)):
                dst = r.local[piece.dst.slices()]
                nbytes += dst.numel() * itemsize
                run = contiguous_run(piece.src.offsets, piece.src.sizes, r.saved.box.sizes)
                start = header.data_start + entry.begin
                if run is None:
                    tasks.append(functools.partial(_read_rows, h, start, r.saved.box.sizes, piece.src.offsets,
                                                   piece.src.sizes, dst, max_read_bytes))
                    continue
                at = start + run[0] * itemsize
                if dst.device.type == "cpu" and dst.is_contiguous():
                    view, n = byte_view(dst), dst.numel() * itemsize
                    segments += [(at + k, view[k:k + (part or n)]) for k in range(0, n, part or max(n, 1))]
                    direct_dsts.append(dst)
                else:
                    tasks.append(functools.partial(_buffered, h, at, dst))
        for group in adjacent_groups([(at, at + len(v)) for at, v in segments]):
            run_: list[tuple[int, memoryview]] = []
            for i in group:
                if run_ and part and sum(len(v) for _, v in run_) + len(segments[i][1]) > part:
                    tasks.append(functools.partial(_preadv, h, run_))
                    run_ = []
                run_.append(segments[i])
            tasks.append(functools.partial(_preadv, h, run_))
    run_bounded([functools.partial(_no_grad, t) for t in tasks], workers)
    for dst in direct_dsts:
        torch.autograd.graph.increment_version(dst)  # as an in-place copy would
    return nbytes, len(by_file)


def _no_grad(task: Callable[[], None]) -> None:
    with torch.no_grad():  # (per thread)
        task()


def _preadv(h: ReadHandle, run: list[tuple[int, memoryview]]) -> None:
    """Adjacent byte ranges of a file by one request, straight into their destinations."""
    preadv_into(h, [v for _, v in run], run[0][0], h.name)


def _buffered(h: ReadHandle, at: int, dst: torch.Tensor) -> None:
    buf = torch.empty(dst.shape, dtype=dst.dtype)
    pread_into(h, buf, at, h.name)
    dst.copy_(buf)
