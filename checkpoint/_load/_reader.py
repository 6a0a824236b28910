"""``load``: fill a state's tensors in place from a checkpoint, resharding to their layout.

[Note: the steps of a load]
1. Check (every rank; reads only ``index.json``, file sizes and safetensors headers, plus the
   checksummed bytes when ``verify``): each target tensor is in the checkpoint with the same
   dtype and global shape; its saved boxes tile it (``_tiling.tiling_problem``, exact
   duplicates dropped first); the saved boxes meeting each of this rank's boxes
   (``_boxes.local_boxes``) cover it (``_plan.plan_reads``); each data file to read exists with
   the recorded size, keys, dtypes and shapes; with ``verify`` the CRC-32s of this rank's share
   match (file checks: ``_load_checks.check_files``; the target's side: ``_load_plan.plan_load``).
   All problems are agreed on (``_comm.agree``): if any rank found one, every rank raises
   before any target tensor is written.
2. Read (no collective): per data file and item, exactly the overlapping region, in pieces of at
   most ``max_read_bytes`` (``_plan.split``). A piece that is one contiguous byte range (a run of
   dim-0 rows) is read with ``pread``, straight into the destination when possible; column
   slices by reading the dim-0 rows they span, bounded the same way, and copying out. Every read
   goes through the storage, on the files opened once in step 1 (``_files.CheckpointFiles``).
3. Plain values from the index replace the target's; one more agreement ends the call (an I/O
   error in step 2 is raised on every rank).

A checksum covers a *unit*: a chunk of a saved box ([Note: checksum chunks] in
``checkpoint/_base/_checksums.py``), or the whole box when the index records no chunks. With
``verify`` (the default) each unit is checksummed in step 1 by exactly one rank, the one that
reads most of it anyway ([Note: verification shares] in ``_verify_shares.py``), so the extra
reads are the parts of chunks straddling shard boundaries. ``LoadStats.bytes_verified`` counts
them; ``verify=False`` skips it (sizes and headers are always checked).

[Note: readers and a writer]
A load concurrent with a save to the same path sees one whole version or a `CheckpointError`
saying to retry; never a mix, never a false corruption report, and it never changes the folder
(docs/checkpoint.md, "Readers and a writer"). How:

* every rank pins the directory (``Storage.open_dir``; on POSIX a directory descriptor) and
  opens every data file in step 1, so a rename or deletion by the writer changes nothing read;
* the ranks agree that they read the same index (``save_id`` and creation time), else retry;
* a problem found while the path no longer names the pinned version is "being replaced, retry",
  not damage;
* on an object store the index is a pointer, read once ([Note: commit by a pointer] in
  ``checkpoint/_series/_commit.py``), and the version folder it names is pinned by the rule
  there; a checkpoint written in place without a pointer is re-checked by
  ``DirView.is_current`` after the reads (a change means retry; the target may hold part of it);
* a missing path with an intact ``.<name>.replaced-<hex>`` copy is read from that copy, renaming
  nothing. A first save on an object store not yet committed is "an interrupted save; retry or
  run the next save", never "not a checkpoint".
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
        if error is None and not files.pinned and files.replaced():
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


def _open_source(storage: Storage, path: str, attempts: int = 5) -> CheckpointFiles:
    """`open_checkpoint` of ``path``, or of the intact ``.replaced-`` copy next to a missing one
    (`stand_in`); opened again, backing off, when it vanished or its index appeared in between
    (a writer's rename). Vanished at every attempt: "being replaced, retry"; a folder holding
    only a save's version folder: "an interrupted save", never "not a checkpoint"."""
    seen, error = False, None
    for attempt in range(attempts):
        try:
            return open_checkpoint(path, storage)
        except CheckpointError as e:
            error = e
        kind = storage.kind(path)
        seen = seen or kind == "dir"
        if kind == "missing":
            old = stand_in(storage, path)
            if old is None and not seen:
                raise error
            if old is not None:
                try:
                    files = open_checkpoint(old, storage)
                except CheckpointError:
                    pass  # renamed back, or finished, since: look again
                else:
                    _log.warning("%s is missing; reading %s, the intact copy a replace of it left (under way, or "
                                 "interrupted: the next save of the series restores it)", storage.url(path),
                                 storage.url(old))
                    return files
        elif not isinstance(error, IndexMissing) or kind != "dir":
            raise error
        elif storage.kind(storage.join(path, INDEX_FILE)) != "file":
            other = interrupted_save(storage, path)
            if other is not None:
                raise CheckpointError(
                    f"checkpoint {storage.url(path)} has no index.json: a save of it is under way or was interrupted "
                    f"before committing, or it was rotated away (keep_last) ({other} is what is left, deleted by the "
                    "next save of the series); nothing committed is lost: retry the load, or load the series' "
                    "latest_checkpoint") from error
            raise error
        if attempt + 1 < attempts:
            time.sleep(0.005 * 2 ** attempt)
    if seen:
        raise CheckpointError(f"checkpoint {storage.url(path)} is being replaced by a save (it vanished between "
                              f"{attempts} attempts to open it); nothing is damaged: retry the load") from error
    assert error is not None
    raise error


def load(state_dict: dict, path: str | os.PathLike | None = None, *, strict: bool = True, verify: bool = True,
         max_read_bytes: int = 64 << 20, storage: Storage | None = None,
         checkpoint_id: str | os.PathLike | None = None, process_group: Any = None, no_dist: bool = False,
         storage_reader: Any = None, planner: Any = None) -> LoadStats:
    """Fill the tensors of ``state_dict`` in place from the checkpoint at ``path``; collective.

    ``path`` is a local path or an fsspec URL (``memory://...``, ``s3://...``); ``storage``
    chooses the storage explicitly. ``state`` has the structure that was saved; its tensors may
    have any layout (plain, or DTensors on any mesh), whatever they were saved from. Plain values
    in ``state`` are replaced by the saved ones.
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
