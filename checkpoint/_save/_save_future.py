"""An `async_save` handle as a ``concurrent.futures.Future`` and as DCP's ``AsyncSaveResponse``.

torch DCP's ``async_save`` returns a ``Future`` (``.result()``, ``.done()``, ...) or an
``AsyncSaveResponse`` (``.staging_completion`` and ``.upload_completion``, two futures).
`SaveHandle` offers both, on top of its own ``wait()``:

* ``result(timeout=None)`` is ``wait()``: collective, on every rank; it commits the checkpoint
  and returns what ``wait()`` returns (the same value again on later calls), or raises the save's
  `CheckpointError` (again on later calls). With ``timeout`` it raises
  ``concurrent.futures.TimeoutError`` if this rank's background write is still running after
  that many seconds, before any collective (call it again later, on every rank).
* ``exception(timeout=None)``: like ``result`` but returns the error (or ``None``).
* ``done()``: whether this rank's background write has ended (then ``result()`` only runs the
  commit, a short collective). It is per rank, like DCP's: do not branch a collective on it.
* ``add_done_callback(fn)``: ``fn(handle)`` runs once the save has finished (committed or
  failed) on this rank, inside ``result()``/``wait()`` (the commit is collective, so it is not
  run by the background thread); at once if that already happened.
* ``running()``: not finished yet; ``cancel()`` returns False and ``cancelled()`` False (a
  collective save cannot be withdrawn by one rank).
* ``staging_completion``: a finished ``Future`` (the state is copied to CPU memory before
  `async_save` returns); ``upload_completion``: the handle itself.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["FutureMethods"]


class FutureMethods:
    """The mixin of `SaveHandle` (see the module docstring). The class provides
    ``_wait_once()`` (the collective commit), ``_thread`` (the background writer or None) and
    ``_snapshot_error`` (a failed copy to CPU memory, or None)."""

    _thread: Any
    _snapshot_error: BaseException | None

    def _wait_once(self) -> list[str]:
        raise NotImplementedError

    def _future_state(self) -> dict:
        st = self.__dict__.get("_future")
        if st is None:
            st = self.__dict__["_future"] = {"outcome": None, "callbacks": []}
        return st

    def _settle(self, ok: bool, value: Any) -> None:
        st = self._future_state()
        st["outcome"] = (ok, value)
        callbacks, st["callbacks"] = st["callbacks"], []
        for fn in callbacks:
            fn(self)

    def wait(self) -> list[str]:
        """Collective: finish writing, commit the checkpoint, rotate old ones.

        Raises `CheckpointError` on every rank if any rank failed; the checkpoint is then not
        committed. Returns, on every rank, sentences saying what was removed or restored
        (leftovers of the series' unfinished saves, checkpoints rotated away by
        ``keep_last``), also logged at INFO on logger ``shardwise.checkpoint``. Calling it again
        after it returned does nothing (and returns ``[]``); ``result()`` returns the value again.
        """
        if self._future_state()["outcome"] is not None:
            return []
        try:
            said = self._wait_once()
        except BaseException as e:
            self._settle(False, e)
            raise
        self._settle(True, said)
        return said

    def _finish(self, timeout: float | None) -> tuple[bool, Any]:
        st = self._future_state()
        if st["outcome"] is None:
            if timeout is not None and self._thread is not None:
                self._thread.join(timeout)
                if self._thread.is_alive():
                    raise concurrent.futures.TimeoutError(
                        f"this rank's part of the save is still being written after {timeout} s")
            try:
                self.wait()
            except BaseException:
                pass  # recorded by wait()
        return st["outcome"]

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
        return self._thread is None or not self._thread.is_alive()

    def running(self) -> bool:
        return self._future_state()["outcome"] is None

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(handle)`` once the save is finished on this rank (see the module docstring)."""
        st = self._future_state()
        if st["outcome"] is None:
            st["callbacks"].append(fn)
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
    def upload_completion(self) -> FutureMethods:
        """DCP's ``AsyncSaveResponse.upload_completion``: this handle."""
        return self
