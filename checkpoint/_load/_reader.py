"""``load``: fill a state's tensors in place from a checkpoint, resharding to their layout.

[Note: the steps of a load]
1. Check (every rank, reads only ``index.json``, file sizes and safetensors headers, plus the
   checksummed bytes when ``verify``): each target tensor is in the checkpoint with the same
   dtype and global shape; its saved boxes tile it exactly (``_tiling.tiling_problem``, exact
   duplicates dropped first); for each of this rank's boxes (``_boxes.local_boxes``) the saved
   boxes that meet it cover it (``_plan.plan_reads``); each data file to be read exists, has
   the size the index records and holds the expected keys, dtypes and shapes; with ``verify``
   the CRC-32 of each checksum unit in this rank's share matches the index (these file checks
   are ``_load_checks.check_files``; the target's side, which reads each tensor needs, is
   ``_load_plan.plan_load``). All problems are
   agreed on (``_comm.agree``): if any rank found one, every rank raises before any target
   tensor is written, so a failed load leaves the target untouched.
2. Read (every rank, no collective): per data file, per item, exactly the overlapping region
   of the saved box, in pieces of at most ``max_read_bytes`` (``_plan.split``), each copied
   into the destination and dropped. A piece that is one contiguous byte range of the file
   (any run of dim-0 rows, which is what resharding dim-0 shards needs) is read with
   ``pread``, straight into the destination when possible; other pieces (column slices) by
   reading the dim-0 rows they span, at most ``max_read_bytes`` of them at a time (or one
   row), and copying the slice out. Every read goes through the storage, on the data files
   opened once in step 1 (``_files.CheckpointFiles``).
3. Plain values from the index replace the target's plain values; the call ends with one more
   agreement (an I/O error in step 2 is raised on every rank).

A checksum covers a *unit*: a checksum chunk of a saved box (a run of its dim-0 rows, see
[Note: checksum chunks] in ``checkpoint/_base/_checksums.py``), or the whole box when the index records no
chunks for it (a single-chunk box, or a checkpoint written before chunks existed). With
``verify`` (the default) every unit of the target's tensors is checksummed in step 1 by exactly
one rank, before any rank writes: one all-gather of the row ranges each rank reads from each
saved box, then every rank computes the same assignment, each unit to the rank that reads most
of it anyway ([Note: verification shares] in ``_verify_shares.py``). What a rank checksums is
then mostly what it loads (step 2 finds those pages in the page cache); the extra reads are the
parts of chunks that straddle its shard's boundaries, less than one chunk per boundary and
saved box. ``LoadStats.bytes_verified`` counts the bytes it checksummed. ``verify=False``
skips it; sizes and headers are always checked.

[Note: readers and a writer]
What a load sees while another job saves to the same path (docs/checkpoint.md, "Readers and a
writer"): one whole version, or a `CheckpointError` saying the checkpoint is being replaced and
to retry; never a mix of two versions, never a false corruption report, and a reader never
changes the folder (a writer's in-progress state is the writer's to finish). How:

* every rank pins the directory (``Storage.open_dir``) and reads index and data files through
  that pin; on POSIX that is a directory descriptor, so a rename of a new version into place
  does not change what is read, and every data file is opened in step 1 and kept open, so a
  writer deleting the old version after the swap cannot take its bytes away;
* the ranks agree that they read the same index (its ``save_id`` and creation time), else
  "being replaced, retry";
* a problem found while the path no longer names the pinned version (a data file gone because
  the writer deleted the old copy before this rank opened it) is reported as "being replaced,
  retry", not as damage;
* where the storage cannot pin (an object store: ``DirView.is_current`` re-reads the index) a
  load that finds the index changed after reading raises "being replaced, retry" (the target
  may then hold part of the new data: load again);
* a path that is missing while an intact ``.<name>.replaced-<hex>`` checkpoint exists (a replace
  between its two renames, or one that crashed there) is read from that copy, without renaming
  anything (so this works on a read-only mount too); the next save of the series restores it.
  On an object store a replace also passes through a ``<name>`` without ``index.json`` (the old
  index deleted, the new one not copied in yet); when that stays so (the writer was killed) it
  is read from the same copy (`stand_in` in ``checkpoint/_series/_commit.py``), and a first save
  of ``<name>`` stopped while copying in is "an interrupted save; retry or run the next save",
  never "not a checkpoint".
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._base import CheckpointError, IndexMissing, agree, agree_values, phase, rank_and_world
from .._series import interrupted_save, stand_in
from .._state import (FileSystemReader, Leaf, check_alone_state, checkpoint_path, dcp_scope, expand_stateful, flatten,
                      refuse_dcp_extensions, set_values)
from .._format import INDEX_FILE, CheckpointFiles, open_checkpoint
from ._load_checks import check_files
from ._load_plan import plan_load as _plan_load, rank_view
from ._reads import read_all as _read
from .._storage import Storage, storage_for

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


def _retry(files: CheckpointFiles) -> str:
    return (f"checkpoint {files.where} is being replaced by a save (its path now names another version than the one "
            "this load started reading); nothing is damaged: retry the load")


def load_from_index(state: dict, files: CheckpointFiles, *, strict: bool = True, verify: bool = True,
                    max_read_bytes: int = 64 << 20, where: str | None = None) -> LoadStats:
    """`load` from the already opened ``files`` (a checkpoint's, or a folder described by an
    index built elsewhere); ``files`` stays open (the caller closes it)."""
    index = files.index
    where = where or f"checkpoint {files.where}"
    what = f"loading {where}"
    reads: list = []
    leaves: list[Leaf] = []
    given: list[Leaf] = []
    problems: list[str] = []
    blobs: list[tuple[Leaf, torch.Tensor]] = []
    verified = 0
    error: BaseException | str | None = None
    with phase("load/plan"):
        try:
            given = flatten(state)
            view, leaves, blobs, problems = rank_view(index, given, rank_and_world()[0], strict, where)
            with torch.no_grad():
                reads, more = _plan_load(view, leaves, strict, where)
            problems += more
        except Exception as e:
            error = e
    with phase("load/verify"):  # sizes and headers always; checksums of this rank's share with verify
        keys = [leaf.key for leaf in leaves if isinstance(leaf.value, torch.Tensor) and leaf.key in index.tensors]
        planned = [(r.key, r.saved, r.item.src, r.local.element_size()) for r in reads]
        verified, error = check_files(files, keys, planned, verify, problems, error)
        if error is not None and files.replaced():
            error = _retry(files)  # a writer swapped versions under us: not damage (see [Note: readers and a writer])
        agree(error, what)
    with phase("load/read"):  # straight into the targets where it can (see _read)
        read_bytes, nfiles = 0, 0
        try:
            read_bytes, nfiles = _read(files, reads, max_read_bytes)
            set_values(given, view.values)
            for leaf, t in blobs:  # saved bytes values, read as uint8 tensors
                if not isinstance(leaf.parent, tuple):
                    leaf.parent[leaf.slot] = t.numpy().tobytes()
        except Exception as e:
            error = _retry(files) if files.replaced() else e
        if error is None and not files.view.pinned and files.replaced():
            error = _retry(files)  # an object store: the bytes read may be of the next version
        agree(error, what)
    needed = sum(r.item.dst.numel * r.local.element_size() for r in reads)
    ntensors = sum(1 for leaf in leaves if isinstance(leaf.value, torch.Tensor) and leaf.key in index.tensors)
    return LoadStats(ntensors, needed, read_bytes, verified, nfiles)


def agree_version(files: CheckpointFiles, where: str) -> None:
    """Collective: raise on every rank unless every rank opened the same version of the
    checkpoint (its ``save_id`` and creation time); see [Note: readers and a writer]."""
    if not agree_values([f"{files.index.save_id}:{files.index.created_unix_ns}"])[0]:
        # ranks read different versions: a save replaced it in between
        raise CheckpointError(f"{where}: {_retry(files)}")


def _source(storage: Storage, path: str, indexless: bool = False) -> tuple[str, str | None]:
    """The directory a load of ``path`` reads: ``path`` itself, or, when it is missing (or was
    found to be a folder without index, ``indexless``), the intact old copy a replace left
    (`stand_in`: read in place, nothing renamed; see [Note: readers and a writer])."""
    if not indexless and storage.kind(path) != "missing":
        return path, None
    old = stand_in(storage, path)
    if old is None:
        return path, None
    state = "is missing" if storage.kind(path) == "missing" else "has no index.json"
    return old, (f"{storage.url(path)} {state}; reading {storage.url(old)}, the intact copy a replace of it left "
                 "(under way, or interrupted: the next save of the series restores it)")


def _open_source(storage: Storage, path: str, attempts: int = 5) -> CheckpointFiles:
    """`open_checkpoint` of what `_source` names; when that vanished in between (a writer's
    rename), resolved again, up to ``attempts`` times, backing off: a replace under way is not an
    error. If it was there at some attempt and vanished every time (a writer replacing it in a
    tight loop), the error says "being replaced, retry", not that it does not exist. A ``path``
    without index next to a save's copy (a commit that stopped half way on an object store) is
    read from the intact old copy, or else said to be an interrupted save, never "not a
    checkpoint"."""
    seen, indexless = False, False
    for attempt in range(attempts):
        source, said = _source(storage, path, indexless)
        seen = seen or storage.kind(source) == "dir"
        try:
            files = open_checkpoint(source, storage)
        except CheckpointError as e:
            if (isinstance(e, IndexMissing) and attempt + 1 < attempts
                    and storage.kind(storage.join(source, INDEX_FILE)) == "file"):
                continue  # renamed into place since it was opened (a replace on an object store: its two renames)
            moved = storage.kind(source) != "dir" or _source(storage, path, indexless)[0] != source
            if (not moved and source == path and not indexless and attempt + 1 < attempts
                    and stand_in(storage, path) is not None):
                indexless = True  # read the old copy in its place
                continue
            if moved and attempt + 1 < attempts:
                time.sleep(0.005 * 2 ** attempt)
                continue
            if moved and seen:
                raise CheckpointError(f"checkpoint {storage.url(path)} is being replaced by a save (it vanished "
                                      f"between {attempts} attempts to open it); nothing is damaged: retry the load"
                                      ) from e
            other = interrupted_save(storage, path) if source == path else None
            if other is not None:
                raise CheckpointError(
                    f"checkpoint {storage.url(path)} has no index.json: a save is copying it into place or was "
                    f"interrupted while committing it ({other} is that save's); nothing committed is damaged: retry "
                    "the load, or run the next save of the series, which cleans it up") from e
            raise
        if said:
            _log.warning("%s", said)
        return files
    raise AssertionError("unreachable")


def load(state_dict: dict, path: str | os.PathLike | None = None, *, strict: bool = True, verify: bool = True,
         max_read_bytes: int = 64 << 20, storage: Storage | None = None,
         checkpoint_id: str | os.PathLike | None = None, process_group: Any = None, no_dist: bool = False,
         storage_reader: Any = None, planner: Any = None) -> LoadStats:
    """Fill the tensors of ``state_dict`` in place from the checkpoint at ``path``; collective.

    ``path`` is a local path or an fsspec URL (``memory://...``, ``s3://...``); ``storage``
    chooses the storage explicitly (``_storage``). ``state`` has the structure that was saved
    (e.g. ``{"model": get_model_state_dict(model), ...}``); its tensors may have any layout
    (plain, or DTensors with any supported placements on any mesh), independent of the layout
    they were saved from. Plain values in ``state`` are replaced by the saved ones.
    ``strict=False`` skips keys of ``state`` that the checkpoint lacks; keys of the checkpoint
    that ``state`` lacks are always ignored. ``verify`` checks the CRC-32 of every checksum
    chunk (or whole saved box) of the loaded tensors, spread over the ranks, before anything is
    written (see [Note: the steps of a load]). Reads that need a buffer (a destination that is
    not contiguous on the CPU, a column slice) take at most ``max_read_bytes`` at a time; reads
    straight into the target may cover several pieces at once.

    Raises `CheckpointError` on every rank, before modifying any tensor, if the directory is
    not a complete checkpoint or a tensor is missing, of another dtype or shape, or its data
    file is missing, truncated or corrupted; while another job replaces the checkpoint, one
    whole version is loaded or the error says to retry ([Note: readers and a writer]).
    Returns this rank's `LoadStats`.

    torch DCP's form works too: ``load(state_dict, checkpoint_id=path)``; a value with
    ``state_dict()``/``load_state_dict()`` anywhere in the tree (`Stateful`) is loaded through
    them (its ``state_dict()`` is filled, then passed to its ``load_state_dict``);
    ``process_group`` (every rank) and ``no_dist`` (this process alone) as in `save`;
    ``storage_reader=FileSystemReader(path)``, ``planner=DefaultLoadPlanner(...)``.
    """
    if isinstance(storage_reader, FileSystemReader):
        checkpoint_id, storage_reader = checkpoint_path("load", checkpoint_id, storage_reader.path), None
    refuse_dcp_extensions("load", storage_reader=storage_reader, planner=planner)
    strict = strict and not getattr(planner, "allow_partial_load", False)  # DefaultLoadPlanner only, checked above
    path = checkpoint_path("load", path, checkpoint_id)
    target, after = expand_stateful(state_dict)
    check_alone_state("load", target, no_dist)
    with dcp_scope("load", process_group, no_dist):
        stats = _load(target, path, strict, verify, max_read_bytes, storage)
    for fn in after:
        fn()
    return stats


def _load(state: dict, path: str | os.PathLike, strict: bool, verify: bool, max_read_bytes: int,
          storage: Storage | None) -> LoadStats:
    storage, norm = storage_for(path, storage)
    where = f"loading checkpoint {storage.url(norm)}"
    files, error = None, None
    try:
        with phase("load/index"):
            files = _open_source(storage, norm)
        index = files.index
        if verify:
            unchecked = [k for k, t in index.tensors.items()
                         if any(b.crc32 is None and b.chunk_crc32 is None for b in t.boxes)]
            if unchecked:
                raise CheckpointError(f"checkpoint {files.where}: tensor '{unchecked[0]}' (and {len(unchecked) - 1} "
                                      "more) has a box without a checksum (crc32 null), which shardwise never writes: "
                                      "the index is damaged or was edited. Restore it, or load with verify=False to "
                                      "load unchecked data")
    except CheckpointError as e:
        error = e
    except OSError as e:
        error = CheckpointError(f"{storage.url(norm)}: {e.strerror or type(e).__name__}")
    try:
        agree(error, where)
        assert files is not None  # else agree raised
        agree_version(files, where)
        return load_from_index(state, files, strict=strict, verify=verify, max_read_bytes=max_read_bytes)
    finally:
        if files is not None:
            files.close()
