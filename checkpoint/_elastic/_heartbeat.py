"""`start_heartbeat`: turn a dead or frozen peer into a prompt nonzero exit that a launcher restarts.

    hb = start_heartbeat(HeartbeatPolicy(interval_s=1, timeout_s=10))
    ... train ...
    hb.stop()                                              # before the last barrier

[Note: heartbeats over the store]
A peer whose host vanishes closes no connection, so survivors would wait in a collective until
the group's timeout. A daemon thread on every rank bumps ``<prefix>/<rank>`` in the c10d store
every ``interval_s`` and watches rank ``rank + 1 mod W`` (O(1) store operations per beat). When
that counter stalls for ``timeout_s`` (or the store is unreachable) it sets ``<prefix>/dead``;
every rank reads it each beat and calls ``os._exit(policy.exit_code)`` from the thread, so the job
stops within about ``timeout_s + 2 interval_s`` and torchrun restarts it. ``prefix`` is drawn per
group, so a restart never meets old keys; `Heartbeat.stop` jumps the counter past ``FINISHED`` so
a rank done first is not taken for dead. A peer alive but stuck in a collective is bounded only
by the group's timeout (``init_distributed(timeout_s=...)``).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

__all__ = ["FINISHED", "Heartbeat", "HeartbeatPolicy", "exit_for_restart", "start_heartbeat"]

FINISHED = 1 << 40  # a counter at or above this belongs to a rank that stopped on purpose


@dataclass(frozen=True)
class HeartbeatPolicy:
    """``interval_s``: seconds between beats; ``timeout_s``: a peer silent this long is dead;
    ``exit_code``: this process's exit status then (75, ``EX_TEMPFAIL``: try again)."""

    interval_s: float = 1.0
    timeout_s: float = 10.0
    exit_code: int = 75

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not self.timeout_s > self.interval_s:
            raise ValueError(f"HeartbeatPolicy: need 0 < interval_s < timeout_s, got interval_s={self.interval_s}, "
                             f"timeout_s={self.timeout_s}")


class Heartbeat:
    """The beating and watching thread of one rank (see [Note: heartbeats over the store]).
    ``on_dead(message)`` replaces the exit (for embedding; the default prints and exits)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, policy: HeartbeatPolicy, *,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.store, self.rank, self.world_size, self.policy = store, rank, world_size, policy
        self.peer = (rank + 1) % world_size
        self.on_dead = on_dead or self._exit
        self.dead: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardwise-heartbeat rank {rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self.store.add(str(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and mark this rank finished (not dead) for its watcher."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self.store.add(str(self.rank), FINISHED)
        except Exception:
            pass  # the store is gone: nobody is watching any more

    def _exit(self, message: str) -> None:
        exit_for_restart(message, self.policy.exit_code)

    def _run(self) -> None:
        p = self.policy
        seen, since = -1, time.monotonic()
        while not self._stop.wait(p.interval_s):
            try:
                self.store.add(str(self.rank), 1)
                if self.world_size > 1 and self.store.add("dead", 0):
                    why = self.store.get("why").decode(errors="replace")
                    return self._dead(f"rank {self.rank}: {why}")
                count = self.store.add(str(self.peer), 0) if self.world_size > 1 else seen
            except Exception as e:  # the store's host is gone, or the store refuses
                return self._dead(f"rank {self.rank} cannot reach the heartbeat store ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})")
            now = time.monotonic()
            if count >= FINISHED:
                continue
            if count != seen:
                seen, since = count, now
            elif now - since > p.timeout_s:
                why = f"rank {self.peer} sent no heartbeat for {now - since:.1f} s (timeout {p.timeout_s} s)"
                try:
                    self.store.set("why", why)
                    self.store.add("dead", 1)
                except Exception:
                    pass
                return self._dead(f"rank {self.rank}: {why}")

    def _dead(self, message: str) -> None:
        if self._stop.is_set():
            return
        self.dead = message
        self.on_dead(message)


def exit_for_restart(message: str, code: int = 75) -> None:
    """The default ``on_dead``: say why on stderr and end the process at once with ``code``
    (``os._exit``: callable from any thread, while the main thread waits inside a collective)."""
    print(f"shardwise heartbeat: {message}; exiting with status {code} so that the launcher restarts the job",
          file=sys.stderr, flush=True)
    os._exit(code)


def _torchrun_store(timeout_s: float) -> dist.Store:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise RuntimeError("start_heartbeat: no store given and MASTER_ADDR / MASTER_PORT are unset; launch with "
                           "torchrun or pass store=")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def start_heartbeat(policy: HeartbeatPolicy | None = None, *, store: dist.Store | None = None,
                    on_dead: Callable[[str], None] | None = None) -> Heartbeat:
    """Start this rank's heartbeat thread over the default process group; collective (rank 0's
    key prefix is broadcast). ``store``: any c10d store every rank reaches (default: a client of
    torchrun's store at ``MASTER_ADDR:MASTER_PORT``). Returns the `Heartbeat`; call ``stop()``
    before the job's last collective."""
    policy = policy or HeartbeatPolicy()
    if not dist.is_initialized():
        raise RuntimeError("start_heartbeat: initialise the process group first (init_distributed())")
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    base = store if store is not None else _torchrun_store(max(policy.timeout_s, 5.0))
    return Heartbeat(dist.PrefixStore(f"shardwise-heartbeat/{token[0]}", base), rank, world, policy,
                     on_dead=on_dead).start()
