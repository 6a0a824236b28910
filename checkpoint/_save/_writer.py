"""``save`` and ``async_save``: every rank writes the boxes it owns, rank 0 commits the index.

[Note: the steps of a save]
1. Plan (every rank, no I/O): flatten the state; for each tensor, this rank's boxes and
   whether it is their writer (see [Note: boxes of a placement] in ``checkpoint/_geometry/_boxes.py``); plain
   values to JSON. Problems are agreed on (``_comm.agree``) before anything is written.
2. Rank 0 checks the target and creates the temporary directory; its name goes to every rank.
3. ``async_save`` only: copy every box this rank writes, once, to the CPU memory its background
   write reads (`_stage`): a fresh snapshot for the thread, the writer process's shared staging
   buffer for ``async_checkpointer_type="process"``. From here on the caller may change the
   state; the checkpoint holds the values of this moment. An error here (no memory, no room in
   ``/dev/shm``, no writer process) is kept for ``wait()``, which raises it on every rank.
4. Every writing rank streams its boxes into ``rank-<rank>.safetensors`` (CRC-32 of each box
   and of each of its checksum chunks on the way, [Note: checksum chunks] in ``checkpoint/_base/_checksums.py``)
   and fsyncs it. ``async_save`` does this in a background thread, or with
   ``async_checkpointer_type="process"`` in the rank's writer process ([Note: the writer
   process] in ``_process_writer.py``); neither does a collective (a collective there could
   interleave with the training's own).
5. Commit (collective; for ``async_save`` inside ``SaveHandle.wait()``): agree on write errors;
   gather each rank's file and boxes on rank 0, which checks that all ranks saved the same
   tensors, writes ``index.json`` last and renames the directory into place ([Note: atomic
   commit] in ``checkpoint/_series/_commit.py``), then rotates old checkpoints. Every rank returns only once the
   checkpoint is committed, or raises the same error; a failed save leaves no directory
   behind except when a process died (then an ``incomplete`` one).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

from .._base import agree, phase, rank_and_world
from .._series import default_series, temp_dir_for
from .._state import (FileSystemWriter, async_checkpointer_kind, check_alone_state, checkpoint_path, dcp_scope,
                      expand_stateful, refuse_dcp_extensions)
from .._storage import Storage, storage_for
from ._process_writer import ProcessWriter
from ._save_handle import SaveHandle
from ._save_plan import SavePlan, keep_own_pieces, plan_save, snapshot
from ._save_target import check_save_target, prepare as _prepare

__all__ = ["save", "async_save", "SaveHandle", "check_save_target"]


def _start(state: dict, path: str | os.PathLike, keep_last: int | None, background: str | None, series: str | None,
           storage: Storage | None) -> SaveHandle:
    """Steps 1-3 of [Note: the steps of a save]; ``background``: None (`save`), ``"thread"`` or
    ``"process"`` (`async_save`'s checkpointer kind)."""
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    storage, path = storage_for(path, storage)
    series = default_series(storage.name(path)) if series is None else series
    if not isinstance(series, str) or not series:
        raise ValueError(f"series must be a non-empty str, got {series!r}")
    rank, _ = rank_and_world()
    plan: SavePlan | None = None
    error: BaseException | None = None
    with phase("save/plan"):
        try:
            plan = plan_save(state, rank)
            plan.path = storage.url(path)
        except Exception as e:
            error = e
        agree(error, f"saving checkpoint {storage.url(path)}")
    assert plan is not None  # else agree raised
    with phase("save/owners"):
        keep_own_pieces(plan, rank)
    with phase("save/prepare"):
        setup = _prepare(storage, path, series, rank)
    tmp = temp_dir_for(storage, path, setup["token"])
    snapshot_error, job = None, None
    if background:
        with phase("save/snapshot"):
            try:
                job = _stage(plan, storage, tmp, rank, background)
            except Exception as e:  # e.g. out of CPU memory on this rank: every rank learns it in wait()
                snapshot_error = e
    return SaveHandle(storage, path, plan, tmp, setup["token"], keep_last, background, snapshot_error, series,
                      setup["said"], job)


def _stage(plan: SavePlan, storage: Storage, tmp: str, rank: int, kind: str) -> concurrent.futures.Future | None:
    """Step 3 of [Note: the steps of a save]: copy each box this rank writes once, from the live
    tensor to the memory the background write reads. For the writer process that is its
    staging buffer (`ProcessWriter.submit` copies and hands over the job, whose report is the
    returned future); for the thread, a snapshot in fresh CPU memory (None: the handle starts
    the thread)."""
    if kind == "process":
        ProcessWriter.check_storage(storage)  # before a writer process is started for nothing
        return ProcessWriter.get().submit(plan, storage, tmp, rank)
    snapshot(plan)
    return None


def save(state_dict: dict, path: str | os.PathLike | None = None, *, keep_last: int | None = None,
         series: str | None = None, storage: Storage | None = None, checkpoint_id: str | os.PathLike | None = None,
         process_group: Any = None, no_dist: bool = False, storage_writer: Any = None, planner: Any = None,
         use_collectives: bool = True) -> list[str]:
    """Save ``state_dict`` to the checkpoint directory ``path``; collective over the default group.

    ``state_dict`` is a dict tree of tensors, DTensors and plain (JSON) values, the same structure on
    every rank. Each piece of tensor data is written once, by one rank holding it (agreed over
    the whole world); before anything is written the ranks check that their pieces tile every
    tensor exactly. The checkpoint appears at ``path`` atomically when complete (an existing
    checkpoint there is replaced; files a user added to it are kept). The save belongs to the
    *series* ``series`` (default: ``path``'s name without trailing digits), recorded in the
    parent folder ([Note: series] in ``checkpoint/_series/_series.py``): it first cleans up the series' unfinished
    saves, and ``keep_last=N`` then deletes all but the ``N`` newest checkpoints of the series.
    Returns sentences saying what was removed or restored. Raises `CheckpointError` on every
    rank on failure. ``path`` is a local path or an fsspec URL (``s3://bucket/ckpt/step-100``);
    ``storage`` chooses the storage explicitly (``_storage``).

    torch DCP's form works too: ``save(state_dict, checkpoint_id=path)``, values with
    ``state_dict()``/``load_state_dict()`` anywhere in the tree (`Stateful`: their
    ``state_dict()`` is saved), ``process_group`` (every rank) and ``no_dist`` (this process
    alone), ``storage_writer=FileSystemWriter(path)``; other ``storage_writer`` objects and ``planner`` are
    refused naming the shardwise way (``_dcp_api``).
    """
    if isinstance(storage_writer, FileSystemWriter):
        checkpoint_id, storage_writer = checkpoint_path("save", checkpoint_id, storage_writer.path), None
    refuse_dcp_extensions("save", storage_writer=storage_writer, planner=planner, use_collectives=use_collectives)
    path = checkpoint_path("save", path, checkpoint_id)
    state = expand_stateful(state_dict)[0]
    check_alone_state("save", state, no_dist)
    with dcp_scope("save", process_group, no_dist):
        return _start(state, path, keep_last, None, series, storage).wait()


def async_save(state_dict: dict, path: str | os.PathLike | None = None, *, keep_last: int | None = None,
               series: str | None = None, storage: Storage | None = None,
               checkpoint_id: str | os.PathLike | None = None, process_group: Any = None, no_dist: bool = False,
               storage_writer: Any = None, planner: Any = None, async_checkpointer_type: Any = None,
               async_stager: Any = None, use_collectives: bool = True) -> SaveHandle:
    """Like `save`, but return once the state is copied to CPU memory; files are written in a
    background thread (``async_checkpointer_type`` None or ``"thread"``, or DCP's
    ``AsyncCheckpointerType.THREAD``) or in this rank's writer process (``"process"`` /
    ``AsyncCheckpointerType.PROCESS``). Collective. Call ``handle.wait()`` (collective, on every rank) before
    the next save: it commits the checkpoint and raises any error from the background write.
    A handle never waited for commits nothing and warns at exit (`SaveHandle`).

    Takes DCP's forms as `save` does; the handle is also a ``concurrent.futures.Future``
    (``handle.result()`` is ``handle.wait()``) and DCP's ``AsyncSaveResponse``
    (``.staging_completion``, ``.upload_completion``): see ``_save_handle.py``.
    """
    if isinstance(storage_writer, FileSystemWriter):
        checkpoint_id, storage_writer = checkpoint_path("async_save", checkpoint_id, storage_writer.path), None
    refuse_dcp_extensions("async_save", storage_writer=storage_writer, planner=planner, async_stager=async_stager,
                          use_collectives=use_collectives)
    kind = async_checkpointer_kind(async_checkpointer_type)
    path = checkpoint_path("async_save", path, checkpoint_id)
    state = expand_stateful(state_dict)[0]
    check_alone_state("async_save", state, no_dist)
    with dcp_scope("async_save", process_group, no_dist):
        return _start(state, path, keep_last, kind, series, storage)
