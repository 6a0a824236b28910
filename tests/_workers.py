"""Persistent workers: one gloo process per rank, reused from call to call.

Usage::

    from tests._dist import run_on_workers

    def _train(rank, world_size, impl):        # module level, as for run_ranks
        ...
        return losses

    def test_train():
        assert run_on_workers(_train, 4, "shardwise", timeout=60)[0] == ...

`run_ranks` forks fresh ranks for every call, so each test starts from a clean process. A long
training job, a notebook or an evaluation loop does not: it builds model after model and mesh
after mesh in the same processes and the same default process group. State that outlives a
model there (DTensor's sharding-propagation cache, mesh objects and their sub-groups, module
hooks, class-level registries) only shows up when the processes are reused, which is what this
mode does:

* a pool of ``world_size`` workers (1 to `MAX_WORKERS`) is forked from the same preloaded
  forkserver as `run_ranks`; each joins one gloo default group at start and then runs call
  after call, ``fn(rank, world_size, *args)``, in that group. Nothing is reset between calls.
* ``new_group=True`` destroys the default group before the call and joins a new one in the same
  processes (a job that re-initializes its group: meshes built on the old one must not be used).
* one pool at a time: a call with another world size shuts the pool down and starts a new one
  (tests of one size are best kept together).
* any failure retires the whole pool: a rank that raised, died (segfault, ``os._exit``) or was
  still running at ``timeout``; every worker is killed and the next call starts fresh workers
  (the group cannot be re-formed around one replaced rank). A worker found dead before a call
  (killed while idle) is replaced the same way. Failures are reported as `run_ranks` reports
  them (`RankFailure`, first failing rank's traceback, stacks of hung ranks).

Workers get the environment of `run_ranks` ranks (torchrun's variables, one thread each), fixed
for the pool's lifetime: tests that need other variables use `run_ranks(env=...)`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from tests._dist import (
    _collect,
    _forkserver_context,
    _pickle_body,
    _Rank,
    _rank_env,
    _stop,
    note_launch,
    send_outcome,
    set_up_process,
)

__all__ = ["MAX_WORKERS", "run_on_workers", "shutdown_workers", "worker_pool_info"]

MAX_WORKERS = 4
_GROUP_TIMEOUT_S = 600.0  # collectives never time out first: each call's own deadline kills hung workers


@dataclass
class _Pool:
    world_size: int
    workdir: tempfile.TemporaryDirectory
    ranks: list[_Rank] = field(default_factory=list)
    serial: int = 0  # how many pools were started before this one in this test session
    calls: int = 0


_pool: _Pool | None = None
_started = 0


def run_on_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                   new_group: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on the persistent workers; return the per-rank values.

    Args:
        fn: a module-level function; ``args`` and its return value must pickle.
        world_size: 1 to `MAX_WORKERS`; a size other than the running pool's restarts the pool.
        timeout: seconds for this call, counted from when the job is handed to the workers.
        new_group: destroy the default process group and join a new one before ``fn`` runs.

    Raises:
        tests._dist.RankFailure: as `run_ranks`; the pool is then retired and the next call starts anew.
    """
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORKERS:
        raise ValueError(f"run_on_workers: world_size={world_size!r}; use 1..{MAX_WORKERS}")
    if timeout <= 0:
        raise ValueError(f"run_on_workers: timeout={timeout!r}; use a positive number of seconds")
    note_launch()
    payload = pickle.dumps((_pickle_body(fn, args), bool(new_group)))
    pool = _pool_for(world_size, fn)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        for r in pool.ranks:
            r.stack_offset = os.path.getsize(r.stack_path) if os.path.exists(r.stack_path) else 0
            r.conn.send_bytes(payload)
        pool.calls += 1
        return _collect(pool.ranks, name, time.monotonic() + timeout, timeout)
    except BaseException:
        _retire()
        raise


def worker_pool_info() -> dict[str, Any] | None:
    """The running pool: ``world_size``, ``pids`` by rank, ``serial`` (pools started before it),
    ``calls`` (calls it has run). None when no pool is running."""
    if _pool is None:
        return None
    return {"world_size": _pool.world_size, "pids": [r.proc.pid for r in _pool.ranks],
            "serial": _pool.serial, "calls": _pool.calls}


def shutdown_workers() -> None:
    """Stop the pool (workers destroy their group and exit). Also run at interpreter exit."""
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        _stop(pool.ranks)
        pool.workdir.cleanup()


def _retire() -> None:
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        for r in pool.ranks:
            r.proc.kill()
        _stop(pool.ranks)
        pool.workdir.cleanup()


def _pool_for(world_size: int, fn: Callable[..., Any]) -> _Pool:
    global _pool, _started
    if _pool is not None and (_pool.world_size != world_size or not all(r.proc.is_alive() for r in _pool.ranks)):
        _retire()  # another size, or a worker died while idle: start over
    if _pool is None:
        ctx = _forkserver_context(fn)
        pool = _Pool(world_size, tempfile.TemporaryDirectory(prefix="shardwise-workers-"), serial=_started)
        _started += 1
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                stack_path = os.path.join(pool.workdir.name, f"rank{rank}.stacks")
                proc = ctx.Process(target=_worker_main, name=f"worker{rank}", daemon=True,
                                   args=(rank, world_size, pool.workdir.name, stack_path,
                                         _rank_env(rank, world_size, None), child_end))
                proc.start()
                child_end.close()
                pool.ranks.append(_Rank(rank, proc, parent_end, stack_path))
        except BaseException:
            for r in pool.ranks:
                r.proc.kill()
            _stop(pool.ranks)
            pool.workdir.cleanup()
            raise
        _pool = pool
    return _pool


def _join_group(rank: int, world_size: int, workdir: str, generation: int) -> None:
    store = dist.FileStore(os.path.join(workdir, f"store{generation}"), world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                            timeout=timedelta(seconds=_GROUP_TIMEOUT_S))


def _worker_main(rank, world_size, workdir, stack_path, env, conn):
    """One worker: join the group, then run jobs until the parent closes the pipe."""
    set_up_process(stack_path, env)
    joins = 0  # store file of the n-th group these workers form (all ranks count alike)
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:
            break
        try:
            body, new_group = pickle.loads(job)
            if new_group and dist.is_initialized():
                dist.destroy_process_group()
            if not dist.is_initialized():  # first call, new_group, or the last body destroyed it
                _join_group(rank, world_size, workdir, joins)
                joins += 1
            fn, args = pickle.loads(body)
            outcome = ("ok", fn(rank, world_size, *args))
        except BaseException:
            outcome = ("error", traceback.format_exc())
        send_outcome(conn, rank, outcome)
    if dist.is_initialized():
        dist.destroy_process_group()


atexit.register(shutdown_workers)

