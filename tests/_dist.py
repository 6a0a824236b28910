"""Multi-rank test harness: run one function on N real gloo processes on CPU.

Usage::

    from tests._dist import run_ranks

    def _sum_ranks(rank, world_size, scale):   # module level: ranks import it by name
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item() * scale

    def test_sum_ranks():
        assert run_ranks(_sum_ranks, 4, 2.0) == [12.0] * 4

Ranks are forked from a forkserver that has already imported torch,
shardwise and the test modules (started once per session, on the first call;
then about 0.2 s a call for 4 ranks, instead of 10-30 s for fresh spawns).
Each rank sets ``torch.set_num_threads(1)``, torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` = ``world_size`` unless
given, ``GROUP_RANK``), ``GLOO_SOCKET_IFNAME`` = loopback unless set, then
``env``; joins a gloo default group (``FileStore`` in a fresh temp dir),
runs ``fn(rank, world_size, *args)`` and reports the result. Ranks stay alive
until every rank has reported (one exiting early would break the gloo
sockets of the others), then destroy the group and exit.

Ranks inherit the environment the forkserver started with, not later changes
of ``os.environ`` (``monkeypatch.setenv`` does not reach them): pass ``env``.
Bodies run without pytest's assertion rewriting, so give asserts messages.
Needs pytest's default ``prepend`` import mode (tests import as ``tests.*``).

`run_on_workers` (``tests/_workers.py``, re-exported here) runs bodies the same way on
persistent workers reused from call to call, as a long job or a notebook reuses its processes.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

MAX_WORLD_SIZE = 8
NEAR_TIMEOUT = 0.5  # a run taking more than this share of its timeout is warned about


class NearTimeoutWarning(UserWarning):
    """A `run_ranks` call that took more than `NEAR_TIMEOUT` of its timeout."""

_FAILURE_GRACE_S = 0.5  # after a first failure, how long other ranks may still report
_STACK_DUMP_WAIT_S = 1.0
_EXIT_WAIT_S = 5.0  # after success, how long ranks may take to tear down
_STACK_SIGNAL = signal.SIGUSR1
_context: multiprocessing.context.BaseContext | None = None


class RankFailure(AssertionError):
    """Ranks raised, crashed, or did not finish within the timeout.

    ``errors``: rank -> traceback text, in the order they arrived; ``hung``:
    the ranks still running at the timeout (empty when a rank failed).
    """

    def __init__(self, message: str, errors: dict[int, str], hung: list[int]):
        super().__init__(message)
        self.errors = errors
        self.hung = hung


_LAUNCHES = 0


def launches() -> int:
    """How many times this process has launched ranks (`run_ranks` or `run_on_workers` calls):
    the fast tier's budget plugin tells multi-rank tests by it (tests/_fast_tier.py)."""
    return _LAUNCHES


def note_launch() -> None:
    global _LAUNCHES
    _LAUNCHES += 1


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              env: Mapping[str, Any] | None = None, init_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level function (ranks import it by name); ``args`` and
            its return value must pickle.
        world_size: 1 to `MAX_WORLD_SIZE`.
        timeout: seconds for the whole run, counted once all ranks have
            started; also each rank's collective timeout.
        env: extra environment variables for every rank (values are str()-ed;
            None unsets one). A ``LOCAL_WORLD_SIZE`` here simulates several
            hosts (``LOCAL_RANK``/``GROUP_RANK`` follow it).
        init_group: False skips the default process group (for tests of code
            that initializes it itself).

    Returns the per-rank return values, by rank.

    Raises:
        RankFailure: a rank raised or died (the message names the first rank
            to fail and has its traceback; other ranks get 0.5 s to report
            their own failures, then all are killed), or ranks were still
            running after ``timeout`` (all are killed; the message names
            them and has their Python stacks).
    """
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"run_ranks: world_size={world_size!r}; use 1..{MAX_WORLD_SIZE}")
    if timeout <= 0:
        raise ValueError(f"run_ranks: timeout={timeout!r}; use a positive number of seconds")
    note_launch()
    payload = _pickle_body(fn, args)
    ctx = _forkserver_context(fn)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    with tempfile.TemporaryDirectory(prefix="shardwise-ranks-") as workdir:
        ranks: list[_Rank] = []
        try:
            for rank in range(world_size):
                ranks.append(_start_rank(ctx, rank, world_size, payload, workdir, timeout,
                                         env, init_group))
            started = time.monotonic()
            results = _collect(ranks, name, started + timeout, timeout)
            took = time.monotonic() - started
            if took > NEAR_TIMEOUT * timeout:  # listed in pytest's warnings summary, so a CI log shows it
                warnings.warn(f"{name} on {world_size} ranks took {took:.0f} s of its timeout={timeout:.0f} s; "
                              "a loaded machine may time it out", NearTimeoutWarning, stacklevel=2)
        except BaseException:
            for r in ranks:  # failed or hung: no clean exit needed
                r.proc.kill()
            raise
        finally:
            _stop(ranks)
        return results


@dataclass
class _Rank:
    rank: int
    proc: Any  # multiprocessing Process of the forkserver context
    conn: Any  # parent end of the rank's pipe: outcome in; closing it releases the rank
    stack_path: str
    stack_offset: int = 0  # where this call's stack dump starts in stack_path (persistent workers)


def _pickle_body(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    if not callable(fn) or "<" in getattr(fn, "__qualname__", ""):
        raise TypeError(f"run_ranks: fn={fn!r} is not a module-level function; rank processes "
                        "import fn by name, so define it at the top level of the test module")
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_ranks: cannot pickle fn or args for the ranks: {exc}") from exc


def _forkserver_context(fn: Callable[..., Any]) -> multiprocessing.context.BaseContext:
    """The forkserver context, started on first use with the modules preloaded."""
    global _context
    if _context is None:
        preload = ["torch", "torch.distributed", "torch.distributed.device_mesh", "torch._dynamo"]
        preload += sorted(n for n in sys.modules if n.partition(".")[0] in ("shardwise", "tests"))
        module = getattr(fn, "__module__", None)
        if module and module != "__main__" and module not in preload:
            preload.append(module)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(preload)
        # Python 3.11's forkserver imports the preload before applying our
        # sys.path; PYTHONPATH makes `tests.*` importable there from any cwd.
        old = os.environ.get("PYTHONPATH")
        path = [os.path.abspath(p) for p in sys.path if os.path.isdir(p or os.curdir)]
        os.environ["PYTHONPATH"] = os.pathsep.join(path)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _context = ctx
    return _context


def _rank_env(rank: int, world_size: int, env: Mapping[str, Any] | None) -> dict[str, str | None]:
    extra = dict(env or {})
    local = int(extra.get("LOCAL_WORLD_SIZE") or world_size)
    out: dict[str, Any] = dict(
        RANK=rank, WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=local, LOCAL_RANK=rank % local,
        GROUP_RANK=rank // local, OMP_NUM_THREADS=1,
    )
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # all ranks are local: use loopback
        out["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    out.update(extra)
    return {k: None if v is None else str(v) for k, v in out.items()}


def _start_rank(ctx, rank, world_size, payload, workdir, timeout, env, init_group) -> _Rank:
    parent_end, child_end = ctx.Pipe()
    stack_path = os.path.join(workdir, f"rank{rank}.stacks")
    store_path = os.path.join(workdir, "store")
    args = (rank, world_size, payload, store_path, stack_path, timeout,
            _rank_env(rank, world_size, env), init_group, child_end)
    proc = ctx.Process(target=_rank_main, name=f"rank{rank}", args=args, daemon=True)
    proc.start()
    child_end.close()
    return _Rank(rank, proc, parent_end, stack_path)


def set_up_process(stack_path: str, env: Mapping[str, Any]) -> None:
    """In a rank or worker process: Python stacks to ``stack_path`` on ``SIGUSR1`` (a hang) and
    on a crash (SIGSEGV, SIGABRT...), ``env`` applied (None: unset), one thread."""
    stacks = open(stack_path, "w")  # stays open for faulthandler until the process exits
    faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(1)


def _rank_main(rank, world_size, payload, store_path, stack_path, timeout, env, init_group, conn):
    """One rank: report ("ok", value) or ("error", traceback), wait for release."""
    try:
        set_up_process(stack_path, env)
        fn, args = pickle.loads(payload)
        if init_group:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                                    timeout=timedelta(seconds=timeout))
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    send_outcome(conn, rank, outcome)
    try:
        conn.recv()  # EOF once the parent has every rank's outcome (or it kills us)
    except EOFError:
        pass
    if outcome[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()


def send_outcome(conn, rank: int, outcome: tuple[str, Any]) -> None:
    """Send a rank's ``("ok", value)`` / ``("error", traceback)`` to the test process.

    Plain pickle: a tensor travels by value (the connection's own pickler would pass it as a
    shared-memory handle that the parent cannot open once the rank is gone). A value that
    cannot be pickled becomes an error naming its type."""
    try:
        conn.send_bytes(pickle.dumps(outcome))
    except Exception:
        conn.send_bytes(pickle.dumps(("error", f"rank {rank} returned a {type(outcome[1]).__name__} that "
                                      f"cannot be sent back to the test:\n{traceback.format_exc()}")))


def _collect(ranks: list[_Rank], name: str, deadline: float, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = {r.rank: r for r in ranks}
    failed_at: float | None = None
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
        now = time.monotonic()
        if now >= limit:
            break
        handles = {h: r for r in pending.values() for h in (r.conn, r.proc.sentinel)}
        for handle in wait(list(handles), timeout=limit - now):
            r = handles[handle]
            outcome = _read_outcome(r) if r.rank in pending else None
            if outcome is None:
                continue
            del pending[r.rank]
            if outcome[0] == "ok":
                results[r.rank] = outcome[1]
            else:
                errors[r.rank] = outcome[1]
                failed_at = failed_at or time.monotonic()
    world_size = len(ranks)
    if errors:
        # a rank that crashed caused the others' "connection closed": report it in full
        first, *others = sorted(errors, key=lambda r: "without reporting a result" not in errors[r])
        lines = [f"rank {first} of {world_size} failed running {name}:", errors[first].rstrip()]
        lines += [f"rank {r} also failed: {errors[r].rstrip().splitlines()[-1]}" for r in others]
        if pending:
            lines.append(f"ranks {sorted(pending)} were still running and were killed")
        raise RankFailure("\n".join(lines), errors, [])
    if pending:
        hung = sorted(pending)
        stacks = _dump_stacks([pending[r] for r in hung])
        msg = (f"ranks {hung} of {world_size} did not finish within timeout={timeout}s "
               f"running {name} (finished: {sorted(results)}); all ranks were killed.\n"
               f"Python stacks of the unfinished ranks at the timeout:\n{stacks}")
        raise RankFailure(msg, {}, hung)
    return [results[rank] for rank in range(world_size)]


def _read_outcome(r: _Rank) -> tuple[str, Any] | None:
    if r.conn.poll():
        try:
            return pickle.loads(r.conn.recv_bytes())
        except EOFError:
            pass  # the rank died without reporting
        except Exception:
            return ("error", f"rank {r.rank}'s result could not be unpickled by the test:\n"
                    f"{traceback.format_exc()}")
    elif r.proc.is_alive():
        return None
    r.proc.join(1.0)
    code = r.proc.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"code {code}"
    dump = _read(r.stack_path, r.stack_offset).rstrip()
    return ("error", f"rank {r.rank} exited with {how} without reporting a result "
            "(crash or os._exit; see the test's captured stderr)"
            + (f"\nPython stacks at the crash:\n{dump}" if dump else ""))


def _dump_stacks(hung: list[_Rank]) -> str:
    for r in hung:
        if r.proc.is_alive():
            os.kill(r.proc.pid, _STACK_SIGNAL)
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < end and not all(_read(r.stack_path, r.stack_offset) for r in hung):
        time.sleep(0.02)
    time.sleep(0.05)  # let the last lines land
    return "\n".join(f"--- rank {r.rank} ---\n{_read(r.stack_path, r.stack_offset).rstrip() or '(no dump)'}"
                     for r in hung)


def _read(path: str, offset: int = 0) -> str:
    try:
        with open(path) as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _stop(ranks: list[_Rank]) -> None:
    """Release the ranks (they destroy their groups and exit); kill stragglers."""
    for r in ranks:
        r.conn.close()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for r in ranks:
        r.proc.join(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        if r.proc.is_alive():
            r.proc.kill()
            r.proc.join(5.0)


from tests._workers import MAX_WORKERS, run_on_workers, shutdown_workers, worker_pool_info  # noqa: E402,F401
