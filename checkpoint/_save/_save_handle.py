"""`SaveHandle`: a save in progress (from `async_save`), finished by its collective ``wait()``.

It is also a ``concurrent.futures.Future`` and DCP's ``AsyncSaveResponse`` (docs/checkpoint.md,
``async_save``): ``result(timeout=None)`` is ``wait()`` (collective; the same value or error on
later calls; with ``timeout``, ``concurrent.futures.TimeoutError`` while this rank's write still
runs, before any collective); ``exception()``; ``done()`` (per rank: do not branch a collective
on it); ``add_done_callback(fn)`` (run inside ``result()``/``wait()``, since the commit is
collective; at once if already finished); ``running()``; ``cancel()`` and ``cancelled()`` False;
``staging_completion`` a finished ``Future``; ``upload_completion`` the handle itself.

The background write runs in a thread of this process (the default) or in this rank's writer
process (``"process"``: [Note: the writer process] in ``_process_writer.py``; ``job`` is the
future of the writer's report). Either way the commit runs in ``wait()``, in this process, and a
writer's error (the process killed included) is raised by ``wait()`` on every rank, with nothing
committed.
"""


from __future__ import annotations

import atexit
import concurrent.futures
import contextvars
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .._base import CheckpointError, agree, broadcast_json, gather_json, phase, rank_and_world
from .._format import DCP_MARKER, INDEX_FILE, dcp_marker, format_index, index_to_json
from .._series import abort_save, commit, finish_save, remove_temp
from .._state import dcp_scope
from .._storage import Storage
from ._save_plan import SavePlan, build_index, meta_digest, write_file as _write_file

__all__ = ["SaveHandle"]

_log = logging.getLogger("shardwise.checkpoint")


class SaveHandle:
    """A save in progress (from `async_save`). ``wait()`` (or ``result()``) finishes it; it is
    also a ``concurrent.futures.Future`` and DCP's ``AsyncSaveResponse`` (the module docstring).

    A handle that is never waited for commits nothing: at interpreter exit this rank warns
    (naming the checkpoint), waits for its background write to end, and rank 0 deletes the
    temporary directory (see [Note: an async save never waited for]).
    """

    def __init__(self, storage: Storage, path: str, plan: SavePlan, tmp: str, token: str, keep_last: int | None,
                 background: str | None, error: BaseException | None = None, series: str = "",
                 said: list[str] | None = None, job: concurrent.futures.Future | None = None) -> None:
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
        self._job: concurrent.futures.Future | None = None  # the writer process's report
        self.async_checkpointer_type = background  # None for save, else "thread" or "process"
        self._outcome: tuple[bool, Any] | None = None  # (True, what wait() said) or (False, its error)
        self._callbacks: list[Callable[[SaveHandle], Any]] = []
        self._alone = rank_and_world() == (0, 1)  # no_dist (or one process): the commit is too
        if background:
            atexit.register(self._at_exit)
        if error is not None:
            return
        if background and self.async_checkpointer_type == "process":
            self._job = job  # submitted by `async_save` with the copy into the staging buffer
        elif background:
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
        self._join()
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

    def wait(self) -> list[str]:
        """Collective: finish writing, commit the checkpoint, rotate old ones.

        Raises `CheckpointError` on every rank if any rank failed; the checkpoint is then not
        committed. Returns, on every rank, sentences saying what was removed or restored
        (leftovers of the series' unfinished saves, checkpoints rotated away by
        ``keep_last``), also logged at INFO on logger ``shardwise.checkpoint``. Calling it again
        after it returned does nothing (and returns ``[]``); ``result()`` returns the value again.
        """
        if self._outcome is not None or self._finished:
            if self._outcome is None:
                self._settle(True, [])
            return []
        self._finished = True
        atexit.unregister(self._at_exit)
        try:
            self._join()
            with phase("save/commit"), dcp_scope("async_save", no_dist=self._alone):
                said = self._commit()["said"]
        except BaseException as e:
            self._settle(False, e)
            raise
        for line in said:
            _log.info("%s", line)
        self._settle(True, said)
        return said

    def _join(self, timeout: float | None = None) -> bool:
        """Wait for this rank's background write (thread or writer process); whether it ended.
        The writer process's report or error becomes this handle's."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        if self._job is not None:
            concurrent.futures.wait([self._job], timeout)
            if not self._job.done():
                return False
            if self._report is None and self._error is None:
                try:
                    self._report = self._job.result()
                except BaseException as e:  # surfaced by wait()
                    self._error = e
        return True

    def _settle(self, ok: bool, value: Any) -> None:
        self._outcome = (ok, value)
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

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
        report = dict(self._report or {}, meta=meta_digest(self._plan.meta)[:16])  # 64 bits: a cross-check
        reports = gather_json(report, dst=0)
        out: dict[str, Any] = {"error": None, "said": []}
        if rank == 0:
            assert reports is not None
            committed = False
            try:
                index = build_index(self._plan, reports, world, self._token)
                st = self._storage
                st.write_atomic(st.join(self._tmp, DCP_MARKER), dcp_marker())  # [Note: the .metadata marker]
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

    def _finish(self, timeout: float | None) -> tuple[bool, Any]:
        if self._outcome is None:
            if timeout is not None and not self._join(timeout):
                raise concurrent.futures.TimeoutError(
                    f"this rank's part of the save is still being written after {timeout} s")
            try:
                self.wait()
            except BaseException:
                pass  # recorded by wait()
        assert self._outcome is not None
        return self._outcome

    def result(self, timeout: float | None = None) -> list[str]:
        """``wait()`` (collective) as ``Future.result``: the commit's sentences, or its error."""
        ok, value = self._finish(timeout)
        if not ok:
            raise value
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """``wait()`` (collective) as ``Future.exception``: the save's error, or None."""
        ok, value = self._finish(timeout)
        return None if ok else value

    def done(self) -> bool:
        """Whether this rank has finished writing its files (``wait()`` still has to commit)."""
        if self._job is not None:
            return self._job.done()
        return self._thread is None or not self._thread.is_alive()

    def running(self) -> bool:
        return self._outcome is None

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(handle)`` once the save is finished on this rank (see the module docstring)."""
        if self._outcome is None:
            self._callbacks.append(fn)
        else:
            fn(self)

    @property
    def staging_completion(self) -> concurrent.futures.Future:
        """DCP's ``AsyncSaveResponse.staging_completion``: the copy to CPU memory (finished)."""
        f: concurrent.futures.Future = concurrent.futures.Future()
        if self._snapshot_error is not None:
            f.set_exception(self._snapshot_error)
        else:
            f.set_result(None)
        return f

    @property
    def upload_completion(self) -> SaveHandle:
        """DCP's ``AsyncSaveResponse.upload_completion``: this handle."""
        return self
