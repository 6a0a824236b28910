"""``load``: fill a state's tensors in place from a checkpoint, resharding to their layout.

[Note: the steps of a load]
1. Check (every rank, reads only ``index.json``, file sizes and safetensors headers, plus the
   checksummed bytes when ``verify``): each target tensor is in the checkpoint with the same
   dtype and global shape; its saved boxes tile it exactly (``_tiling.tiling_problem``, exact
   duplicates dropped first); for each of this rank's boxes (``_boxes.local_boxes``) the saved
   boxes that meet it cover it (``_plan.plan_reads``); each data file to be read exists, has
   the size the index records and holds the expected keys, dtypes and shapes; with ``verify``
   the CRC-32 of each checksum unit in this rank's share matches the index (these file checks
   are ``_load_checks.check_files``). All problems are
   agreed on (``_comm.agree``): if any rank found one, every rank raises before any target
   tensor is written, so a failed load leaves the target untouched.
2. Read (every rank, no collective): per data file, per item, exactly the overlapping region
   of the saved box, in pieces of at most ``max_read_bytes`` (``_plan.split``), each copied
   into the destination and dropped. A piece that is one contiguous byte range of the file
   (any run of dim-0 rows, which is what resharding dim-0 shards needs) is read with
   ``pread``, straight into the destination when possible; other pieces (column slices)
   through ``safe_open(file).get_slice(key)[region]``. Memory beyond the target tensors is
   one piece; the bytes requested are the bytes this rank needs.
3. Plain values from the index replace the target's plain values; the call ends with one more
   agreement (an I/O error in step 2 is raised on every rank).

A checksum covers a *unit*: a checksum chunk of a saved box (a run of its dim-0 rows, see
[Note: checksum chunks] in ``_checksums.py``), or the whole box when the index records no
chunks for it (a single-chunk box, or a checkpoint written before chunks existed). With
``verify`` (the default) every unit of the target's tensors is checksummed in step 1 by exactly
one rank, before any rank writes: one all-gather of the row ranges each rank reads from each
saved box, then every rank computes the same assignment, each unit to the rank that reads most
of it anyway ([Note: verification shares] in ``_verify_shares.py``). What a rank checksums is
then mostly what it loads (step 2 finds those pages in the page cache); the extra reads are the
parts of chunks that straddle its shard's boundaries, less than one chunk per boundary and
saved box. ``LoadStats.bytes_verified`` counts the bytes it checksummed. ``verify=False``
skips it; sizes and headers are always checked.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from ._boxes import LocalBox, local_boxes
from ._comm import agree, rank_and_world
from ._commit import recover_replaced
from ._errors import CheckpointError
from ._file_io import adjacent_groups, byte_view, contiguous_run, open_for_ranges, pread_into, preadv_into
from ._flatten import Leaf, flatten, set_values
from ._format import Index, SavedBox, TensorEntry, read_index
from ._load_checks import check_files
from ._plan import ReadItem, covered_numel, plan_reads, split
from ._safetensors_io import Header
from ._tiling import distinct_boxes, tiling_problem
from ._trace import phase

__all__ = ["load", "LoadStats", "load_from_index"]

_log = logging.getLogger("shardwise.checkpoint")


@dataclass(frozen=True)
class LoadStats:
    """What one rank did in a load (returned by `load`).

    ``bytes_needed``: bytes of this rank's target data; ``bytes_read``: bytes this rank read
    from data files to fill them (only overlapping regions are read, so it equals
    ``bytes_needed``; kernel read-ahead is switched off for these reads); ``bytes_verified``:
    bytes it read to check checksums (its share of the checksum units, with ``verify``);
    ``files_opened``: data files it read from.
    """

    tensors: int
    bytes_needed: int
    bytes_read: int
    bytes_verified: int
    files_opened: int


@dataclass
class _Read:
    key: str
    local: torch.Tensor
    saved: SavedBox
    item: ReadItem


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _check_tensor(key: str, t: torch.Tensor, entry: TensorEntry, where: str, problems: list[str]) -> list[LocalBox]:
    if entry.dtype != t.dtype:
        problems.append(f"tensor '{key}' is {entry.dtype} in {where} but {t.dtype} in the target; cast one of them "
                        "so they agree")
        return []
    if entry.shape != tuple(t.shape):
        problems.append(f"tensor '{key}' has shape {list(entry.shape)} in {where} but {list(t.shape)} in the "
                        "target (a different model configuration?)")
        return []
    if t.device.type == "meta":
        problems.append(f"tensor '{key}' of the target is on the meta device; materialize it before loading")
        return []
    return local_boxes(t)


def _plan_load(index: Index, leaves: list[Leaf], strict: bool, where: str):
    problems: list[str] = []
    reads: list[_Read] = []
    for leaf in leaves:
        t = leaf.value
        if not isinstance(t, torch.Tensor):
            if leaf.key not in index.values and strict:
                problems.append(f"value '{leaf.key}' is not in {where}" + _similar(leaf.key, index.values))
            continue
        entry = index.tensors.get(leaf.key)
        if entry is None:
            if strict:
                problems.append(f"tensor '{leaf.key}' is not in {where}" + _similar(leaf.key, index.tensors))
            continue
        lbs = _check_tensor(leaf.key, t, entry, where, problems)
        if not lbs:
            continue
        keep = distinct_boxes([b.box for b in entry.boxes])  # exact duplicates: see _tiling.py
        saved = [entry.boxes[i] for i in keep]
        saved_boxes = [b.box for b in saved]  # once per tensor, not once per local box
        problem = tiling_problem(entry.shape, saved_boxes)
        if problem is not None:
            problems.append(f"tensor '{leaf.key}' in {where}: {problem}; the index is damaged (run verify)")
            continue
        for lb in lbs:
            items = plan_reads(lb, saved_boxes)
            if covered_numel(items) != lb.box.numel:  # cannot happen after the tiling check; kept as a guard
                problems.append(f"{where} lacks part of tensor '{leaf.key}' (box at {list(lb.box.offsets)} of size "
                                f"{list(lb.box.sizes)} is not fully saved); the index is damaged")
                continue
            reads.extend(_Read(leaf.key, _local(t), saved[it.source], it) for it in items)
    if not strict and leaves and not any(
            (leaf.key in index.tensors) if isinstance(leaf.value, torch.Tensor) else (leaf.key in index.values)
            for leaf in leaves):
        problems.append(f"no key of the target is in {where} (strict=False skips missing keys, but loading nothing at "
                        f"all is almost certainly a mistake: a different model, or a prefix such as 'model/' missing; "
                        f"first target keys: {[leaf.key for leaf in leaves[:3]]}, first saved: {list(index.tensors)[:3]})")
    return reads, problems


def _read(index: Index, reads: list[_Read], headers: dict[str, Header | None],
          max_read_bytes: int) -> tuple[int, int]:
    """Step 2 of [Note: the steps of a load]; returns (bytes read, files opened).

    A piece that is one contiguous byte range of its saved box (any dim-0 slab of a saved box,
    as resharding FSDP/HSDP shards gives) is read with ``pread`` straight into the destination
    when that is contiguous on the CPU (else into a buffer of the piece's size). Direct pieces
    whose byte ranges follow one another in the file (e.g. consecutive saved boxes that all
    land in this rank's shards) are read by one ``preadv`` into all their destinations: fewer,
    larger reads. Other pieces (e.g. column slices) go through
    ``safe_open(...).get_slice(key)[region]``.
    """
    by_file: dict[str, list[_Read]] = defaultdict(list)
    for r in reads:
        by_file[r.saved.file].append(r)
    nbytes = 0
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for name, items in by_file.items():
            path = os.path.join(index.root, name)
            header = headers[name]
            fd = open_for_ranges(path, index.follow_links)
            sliced = None  # safe_open maps the file; opened only for pieces that need it
            direct: list[tuple[int, int, torch.Tensor]] = []  # (file offset, bytes, destination)
            try:
                for r in items:
                    entry = header.entries[r.saved.key]
                    itemsize = r.local.element_size()
                    for piece in split(r.item, max(1, max_read_bytes // itemsize)):
                        dst = r.local[piece.dst.slices()]
                        nbytes += dst.numel() * itemsize
                        run = contiguous_run(piece.src.offsets, piece.src.sizes, r.saved.box.sizes)
                        if run is None:
                            if sliced is None:
                                sliced = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                            dst.copy_(sliced.get_slice(r.saved.key)[piece.src.slices()])
                            continue
                        at = header.data_start + entry.begin + run[0] * itemsize
                        if dst.device.type == "cpu" and dst.is_contiguous():
                            direct.append((at, dst.numel() * itemsize, dst))
                        else:
                            buf = torch.empty(dst.shape, dtype=dst.dtype)
                            pread_into(fd, buf, at, path)
                            dst.copy_(buf)
                for group in adjacent_groups([(at, at + n) for at, n, _ in direct]):
                    preadv_into(fd, [byte_view(direct[i][2]) for i in group], direct[group[0]][0], path)
                    for i in group:
                        torch.autograd.graph.increment_version(direct[i][2])  # as an in-place copy would
            finally:
                os.close(fd)
    return nbytes, len(by_file)


def _similar(key: str, names) -> str:
    close = difflib.get_close_matches(key, list(names), n=3)
    return f" (similar names there: {close})" if close else ""


def load_from_index(state: dict, index: Index, *, strict: bool = True, verify: bool = True,
                    max_read_bytes: int = 64 << 20, where: str | None = None) -> LoadStats:
    """`load` from an already built `Index` (a checkpoint's, or one describing other files)."""
    where = where or f"checkpoint {index.root}"
    what = f"loading {where}"
    reads, leaves, problems, verified = [], [], [], 0
    headers: dict[str, Header | None] = {}
    error: BaseException | None = None
    with phase("load/plan"):
        try:
            leaves = flatten(state)
            with torch.no_grad():
                reads, problems = _plan_load(index, leaves, strict, where)
        except Exception as e:
            error = e
    with phase("load/verify"):  # sizes and headers always; checksums of this rank's share with verify
        keys = [leaf.key for leaf in leaves if isinstance(leaf.value, torch.Tensor) and leaf.key in index.tensors]
        planned = [(r.key, r.saved, r.item.src, r.local.element_size()) for r in reads]
        verified, error = check_files(index, keys, planned, verify, headers, problems, error)
        agree(error, what)
    with phase("load/read"):  # straight into the targets where it can (see _read)
        read_bytes, files = 0, 0
        try:
            read_bytes, files = _read(index, reads, headers, max_read_bytes)
            set_values(leaves, index.values)
        except Exception as e:
            error = e
        agree(error, what)
    needed = sum(r.item.dst.numel * r.local.element_size() for r in reads)
    ntensors = sum(1 for leaf in leaves if isinstance(leaf.value, torch.Tensor) and leaf.key in index.tensors)
    return LoadStats(ntensors, needed, read_bytes, verified, files)


def load(state: dict, path: str | os.PathLike, *, strict: bool = True, verify: bool = True,
         max_read_bytes: int = 64 << 20) -> LoadStats:
    """Fill the tensors of ``state`` in place from the checkpoint at ``path``; collective.

    ``state`` has the structure that was saved (e.g. ``{"model": get_model_state_dict(model),
    ...}``); its tensors may have any layout (plain, or DTensors with any supported placements
    on any mesh), independent of the layout they were saved from. Plain values in ``state``
    are replaced by the saved ones. ``strict=False`` skips keys of ``state`` that the checkpoint
    lacks; keys of the checkpoint that ``state`` lacks are always ignored. ``verify`` checks the
    CRC-32 of every checksum chunk (or whole saved box) of the loaded tensors, spread over the
    ranks, before anything is written (see [Note: the steps of a load]). Reads that need a
    buffer (a destination that is not contiguous on the CPU) take at most ``max_read_bytes`` at
    a time; reads straight into the target may cover several pieces at once.

    Raises `CheckpointError` on every rank, before modifying any tensor, if the directory is
    not a complete checkpoint or a tensor is missing, of another dtype or shape, or its data
    file is missing, truncated or corrupted. Returns this rank's `LoadStats`.
    """
    path = os.path.abspath(os.fspath(path))
    index, error = None, None
    if rank_and_world()[0] == 0 and not os.path.lexists(path):
        try:  # a replace of `path` that stopped between its two renames: restore the old copy
            restored = recover_replaced(path)
            if restored:
                _log.warning("%s", restored)
        except OSError as e:
            error = e
    agree(error, f"loading checkpoint {path}")  # also: no rank reads before rank 0 has restored
    try:
        with phase("load/index"):
            index = read_index(path)
        if verify:
            unchecked = [k for k, t in index.tensors.items()
                         if any(b.crc32 is None and b.chunk_crc32 is None for b in t.boxes)]
            if unchecked:
                raise CheckpointError(f"checkpoint {path}: tensor '{unchecked[0]}' (and {len(unchecked) - 1} more) has "
                                      "a box without a checksum (crc32 null), which shardwise never writes: the index "
                                      "is damaged or was edited. Restore it, or load with verify=False to load "
                                      "unchecked data")
    except CheckpointError as e:
        error = e
    agree(error, f"loading checkpoint {path}")
    return load_from_index(state, index, strict=strict, verify=verify, max_read_bytes=max_read_bytes)

