"""``save`` and ``async_save``: every rank writes the boxes it owns, rank 0 commits the index.

[Note: the steps of a save]
1. Plan (every rank, no I/O): flatten the state; for each tensor, this rank's boxes and
   whether it is their writer (see [Note: boxes of a placement] in ``_boxes.py``); plain
   values to JSON. Problems are agreed on (``_comm.agree``) before anything is written.
2. Rank 0 checks the target and creates the temporary directory; its name goes to every rank.
3. ``async_save`` only: copy every box this rank writes to CPU memory (the snapshot). From
   here on the caller may change the state; the checkpoint holds the values of this moment.
4. Every writing rank streams its boxes into ``rank-<rank>.safetensors`` (CRC-32 of each box
   and of each of its checksum chunks on the way, [Note: checksum chunks] in ``_checksums.py``)
   and fsyncs it. ``async_save`` does this in a background thread, which does no
   collective (a collective there could interleave with the training's own).
5. Commit (collective; for ``async_save`` inside ``SaveHandle.wait()``): agree on write errors;
   gather each rank's file and boxes on rank 0, which checks that all ranks saved the same
   tensors, writes ``index.json`` last and renames the directory into place ([Note: atomic
   commit] in ``_commit.py``), then rotates old checkpoints. Every rank returns only once the
   checkpoint is committed, or raises the same error; a failed save leaves no directory
   behind except when a process died (then an ``incomplete`` one).
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import sys
import threading
import warnings
from typing import Any

from .._base import CheckpointError, agree, broadcast_json, gather_json, phase, rank_and_world
from .._series import abort_save, commit, default_series, finish_save, remove_temp, temp_dir_for
from .._state import check_alone_state, checkpoint_path, dcp_scope, expand_stateful, refuse_dcp_extensions
from .._format import INDEX_FILE, format_index, index_to_json
from ._save_future import FutureMethods
from ._save_plan import (SavePlan, build_index, keep_own_pieces, meta_digest, plan_save, snapshot,
                         write_file as _write_file)
from ._save_target import check_save_target, prepare as _prepare
from .._storage import Storage, storage_for

__all__ = ["save", "async_save", "SaveHandle", "check_save_target"]

_log = logging.getLogger("shardwise.checkpoint")


class SaveHandle(FutureMethods):
    """A save in progress (from `async_save`). ``wait()`` (or ``result()``) finishes it; it is
    also a ``concurrent.futures.Future`` and DCP's ``AsyncSaveResponse`` (``_save_future``).

    A handle that is never waited for commits nothing: at interpreter exit this rank warns
    (naming the checkpoint), waits for its background write to end, and rank 0 deletes the
    temporary directory (see [Note: an async save never waited for]).
    """

    def __init__(self, storage: Storage, path: str, plan: SavePlan, tmp: str, token: str, keep_last: int | None,
                 background: bool, error: BaseException | None = None, series: str = "",
                 said: list[str] | None = None) -> None:
        self._storage = storage
        self.path = storage.url(path)
        self._path = path
        self._plan, self._tmp, self._token, self._keep_last = plan, tmp, token, keep_last
        self._series, self._said = series, list(said or [])
        self._report: dict | None = None
        self._error = error  # a failed snapshot: nothing to write, reported by wait()
        self._snapshot_error = error
        self._finished = False
        self._thread: threading.Thread | None = None
        self._alone = rank_and_world() == (0, 1)  # no_dist (or one process): the commit is too
        if background:
            atexit.register(self._at_exit)
        if error is not None:
            return
        if background:
            context = contextvars.copy_context()  # no_dist's "this process alone" reaches the thread
            self._thread = threading.Thread(target=context.run, args=(self._write,), name=f"shardwise-save {path}",
                                            daemon=True)
            self._thread.start()
        else:
            self._write()

    def _write(self) -> None:
        try:
            with phase("save/write"):
                self._report = _write_file(self._plan, self._storage, self._tmp, rank_and_world()[0])
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _at_exit(self) -> None:
        """[Note: an async save never waited for]
        ``wait()`` is collective, so it cannot run at interpreter exit (the other ranks may be
        gone, the process group destroyed). Committing without it would skip the agreement
        that every rank's files are complete. So the save is abandoned, loudly: a warning names
        the checkpoint, and rank 0 deletes the temporary directory (the next save of the
        series would delete it anyway, from the series record)."""
        if self._finished:
            return
        self._finished = True
        if self._thread is not None:
            self._thread.join()
        try:
            rank = 0 if self._alone else rank_and_world()[0]
        except Exception:  # the process group is already gone
            rank = -1
        msg = (f"shardwise.checkpoint: async_save to {self.path} was never waited for (call handle.wait() on every "
               "rank); the checkpoint was NOT committed")
        if rank == 0 and remove_temp(self._storage, self._tmp):
            msg += f" and its temporary directory {self._storage.url(self._tmp)} was deleted"
        if rank == 0:
            try:
                abort_save(self._storage, self._path, self._series, self._token)
            except (OSError, CheckpointError):
                pass  # the next save of the series cleans it up
        warnings.warn(msg, RuntimeWarning, stacklevel=1)
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)

    def _wait_once(self) -> list[str]:
        """``wait()``'s work (its docstring is in ``_save_future``)."""
        if self._finished:
            return []
        self._finished = True
        atexit.unregister(self._at_exit)
        if self._thread is not None:
            self._thread.join()
        with phase("save/commit"), dcp_scope("async_save", no_dist=self._alone):
            out = self._commit()
        for line in out["said"]:
            _log.info("%s", line)
        return out["said"]

    def _commit(self) -> dict:
        """The commit of `wait` (step 5 of [Note: the steps of a save]); returns rank 0's
        ``{"error", "said"}`` after raising it on every rank if it is an error."""
        rank, world = rank_and_world()
        where = f"saving checkpoint {self.path}"
        try:
            agree(self._error, where)
        except CheckpointError:
            if rank == 0:
                self._abort()
            raise
        report = dict(self._report or {}, meta=meta_digest(self._plan.meta))
        reports = gather_json(report, dst=0)
        out: dict[str, Any] = {"error": None, "said": []}
        if rank == 0:
            assert reports is not None
            committed = False
            try:
                index = build_index(self._plan, reports, world, self._token)
                st = self._storage
                st.write_atomic(st.join(self._tmp, INDEX_FILE), format_index(index_to_json(index)).encode())
                left = commit(st, self._tmp, self._path, self._token)
                committed = True
                said = self._said + [f"kept {p} of the replaced checkpoint (the new one has an entry of that name)"
                                     for p in left]
                said += finish_save(st, self._path, self._series, self._token, index.created_unix_ns, self._keep_last)
                out["said"] = said
            except Exception as e:
                error = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
                if committed:
                    error = f"the checkpoint was committed, but deleting old ones (keep_last) failed: {error}"
                else:
                    self._abort()
                out["error"] = error
        out = broadcast_json(out, src=0)
        if out["error"] is not None:
            raise CheckpointError(f"{where} failed on rank 0: {out['error']}")
        return out

    def _abort(self) -> None:
        remove_temp(self._storage, self._tmp)
        try:
            abort_save(self._storage, self._path, self._series, self._token)
        except (OSError, CheckpointError):
            pass  # the record keeps it pending; the next save of the series cleans it up


def _start(state: dict, path: str | os.PathLike, keep_last: int | None, background: bool, series: str | None,
           storage: Storage | None) -> SaveHandle:
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
    snapshot_error = None
    if background:
        with phase("save/snapshot"):
            try:
                snapshot(plan)
            except Exception as e:  # e.g. out of CPU memory on this rank: every rank learns it in wait()
                snapshot_error = e
    return SaveHandle(storage, path, plan, temp_dir_for(storage, path, setup["token"]), setup["token"], keep_last,
                      background, snapshot_error, series, setup["said"])


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
    parent folder ([Note: series] in ``_series.py``): it first cleans up the series' unfinished
    saves, and ``keep_last=N`` then deletes all but the ``N`` newest checkpoints of the series.
    Returns sentences saying what was removed or restored. Raises `CheckpointError` on every
    rank on failure. ``path`` is a local path or an fsspec URL (``s3://bucket/ckpt/step-100``);
    ``storage`` chooses the storage explicitly (``_storage``).

    torch DCP's form works too: ``save(state_dict, checkpoint_id=path)``, values with
    ``state_dict()``/``load_state_dict()`` anywhere in the tree (`Stateful`: their
    ``state_dict()`` is saved), ``process_group`` (every rank) and ``no_dist`` (this process
    alone); DCP's ``storage_writer``/``planner`` are refused naming the shardwise way (``_dcp_api``).
    """
    refuse_dcp_extensions("save", storage_writer=storage_writer, planner=planner, use_collectives=use_collectives)
    path = checkpoint_path("save", path, checkpoint_id)
    state = expand_stateful(state_dict)[0]
    check_alone_state("save", state, no_dist)
    with dcp_scope("save", process_group, no_dist):
        return _start(state, path, keep_last, False, series, storage).wait()


def async_save(state_dict: dict, path: str | os.PathLike | None = None, *, keep_last: int | None = None,
               series: str | None = None, storage: Storage | None = None,
               checkpoint_id: str | os.PathLike | None = None, process_group: Any = None, no_dist: bool = False,
               storage_writer: Any = None, planner: Any = None, async_checkpointer_type: Any = None,
               async_stager: Any = None, use_collectives: bool = True) -> SaveHandle:
    """Like `save`, but return once the state is copied to CPU memory; files are written in a
    background thread. Collective. Call ``handle.wait()`` (collective, on every rank) before
    the next save: it commits the checkpoint and raises any error from the background write.
    A handle never waited for commits nothing and warns at exit (`SaveHandle`).

    Takes DCP's forms as `save` does; the handle is also a ``concurrent.futures.Future``
    (``handle.result()`` is ``handle.wait()``) and DCP's ``AsyncSaveResponse``
    (``.staging_completion``, ``.upload_completion``): see ``_save_future``.
    """
    refuse_dcp_extensions("async_save", storage_writer=storage_writer, planner=planner, async_stager=async_stager,
                          async_checkpointer_type=async_checkpointer_type, use_collectives=use_collectives)
    path = checkpoint_path("async_save", path, checkpoint_id)
    state = expand_stateful(state_dict)[0]
    check_alone_state("async_save", state, no_dist)
    with dcp_scope("async_save", process_group, no_dist):
        return _start(state, path, keep_last, True, series, storage)
