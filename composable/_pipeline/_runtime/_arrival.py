"""Threads that wait on receives posted ahead, so a rank can wait for the first of two messages.

[Note: waiting for the first arrival]
A pair whose inputs come from two peers runs first the half whose input arrives first ([Note:
forward/backward pairs] in ``_pipeline_schedule.py``). gloo's ``Work.is_completed()`` stays False
until someone waits, so a daemon thread per peer calls ``wait()`` on its receive posted ahead and
sets ``wake``, on which `P2P.wait_first` sleeps; the taker later joins the watcher and re-raises
its error. After a failed step the watchers are forgotten ([Note: after a failed step] in
``_p2p.py``).
"""

from __future__ import annotations

import threading

import torch.distributed as dist

__all__ = ["Watchers"]


class _Watcher:
    """A daemon thread that waits on one posted receive, then sets ``done`` and ``wake``."""

    def __init__(self, work: dist.Work, wake: threading.Event) -> None:
        self.work, self.done = work, threading.Event()
        self.error: BaseException | None = None
        self._wake = wake
        self._thread = threading.Thread(target=self._run, name="shardwise-pp-recv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised where the receive is taken
            self.error = exc
        finally:
            self.done.set()
            self._wake.set()


class Watchers:
    """At most one watcher per peer, for that peer's receive posted ahead."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self._by_peer: dict[int, _Watcher] = {}

    def watch(self, peer: int, work: dist.Work) -> None:
        """Start a thread waiting on ``work`` (``peer``'s posted receive) unless one is."""
        if peer not in self._by_peer:
            self._by_peer[peer] = _Watcher(work, self.wake)

    def done(self, peer: int, work: dist.Work) -> bool:
        """Whether a watcher saw ``work`` complete (or fail)."""
        w = self._by_peer.get(peer)
        return w is not None and w.work is work and w.done.is_set()

    def take(self, peer: int, work: dist.Work) -> bool:
        """Join ``work``'s watcher, re-raising its error; False if none watched it (then wait on it)."""
        w = self._by_peer.pop(peer, None)
        if w is None or w.work is not work:
            return False
        w._thread.join()
        if w.error is not None:
            raise w.error
        return True

    def clear(self) -> None:
        self._by_peer.clear()
