"""`ProcessWriter`: this rank's writer process, which writes the files of `async_save`'s
``async_checkpointer_type="process"`` (DCP's ``AsyncCheckpointerType.PROCESS``).

[Note: the writer process]
A background *thread* shares the GIL with the training loop; with ``"process"`` each rank has one
writer process, started on its first such save and reused (docs/checkpoint.md, "Thread or
process"):

* The training process copies each box straight from the live tensor (``_stage`` in
  ``_writer.py``) into a *staging buffer*: a file in ``/dev/shm`` (else the temporary folder)
  mapped by both processes (``torch.from_file``, shared), reserved up front
  (``posix_fallocate``: a full ``/dev/shm`` is an error, never a ``SIGBUS``), kept for later
  saves (one per save in flight). The writer unlinks a buffer's file once mapped, so nothing
  is left in ``/dev/shm`` when either process dies. On CUDA hosts the buffers are registered
  as pinned memory (not exercised on a CPU-only machine).
* The job goes to the writer over a pipe; it runs the same `write_file` as the thread and
  answers with the rank's report, jobs in the order of the saves.
* The commit stays in ``SaveHandle.wait()`` (collective; the writer has no process group). A
  writer that fails or dies fails only its rank's part: its jobs' futures get a
  `CheckpointError` naming the exit, ``wait()`` agrees on it, rank 0 deletes the temporary
  folder, and the next save starts a new writer.
* Lifetime: started with ``subprocess`` (``python -c``: the training script is not re-imported);
  it exits on a ``stop`` message at interpreter exit, at end of file on its pipe (the training
  process died) and when its parent changes (checked every second). A process forked from the
  training process (a data loader worker) closes its copies of the pipes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing.util
import os
import pickle
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from shardwise.mesh import byte_layout

from .._base import CheckpointError
from .._geometry import Box
from .._storage import Storage
from ._save_plan import Piece, SavePlan, write_file as _write_file

__all__ = ["ProcessWriter", "writer_main"]

_ALIGN = 64  # bytes: every box starts at a multiple (any dtype's view of the buffer is aligned)
_STOP_WAIT_S = 10.0  # at exit, how long the writer may take to finish before it is killed
_ROUND = 1 << 20  # buffers are sized in MiB, so a slightly bigger state reuses them


def _staging_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessWriter:
    """This process's writer process (see [Note: the writer process]); `ProcessWriter.get()`
    gives the running one, starting it if needed. ``submit(plan, storage, tmp, rank)`` copies
    the plan's boxes (the live tensors) into a staging buffer and returns a ``Future`` of
    `write_file`'s report.
    """

    _current: ProcessWriter | None = None
    _start_lock = threading.Lock()

    @classmethod
    def get(cls) -> ProcessWriter:
        """The running writer process of this process, started if there is none (or it died)."""
        with cls._start_lock:
            w = cls._current
            if w is None or w._dead is not None:
                w = cls._current = ProcessWriter()
            return w

    @classmethod
    def shutdown(cls) -> None:
        """Stop this process's writer process, if one runs, once it has written the saves in
        flight; its staging buffers are freed. The next process-mode save starts a new one."""
        w = cls._current
        if w is not None:
            w.stop()

    def __init__(self) -> None:
        job_r, job_w = os.pipe()
        reply_r, reply_w = os.pipe()
        cmd = [sys.executable, "-c", "from shardwise.checkpoint._save._process_writer import writer_main; "
               f"writer_main({job_r}, {reply_w}, {os.getpid()})"]
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=(job_r, reply_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(job_r)
            os.close(reply_w)
        self.pid = self._proc.pid
        self._jobs = Connection(job_w, readable=False)
        self._replies = Connection(reply_r, writable=False)
        self._lock = threading.Lock()  # the fields below, and sends on the pipe
        self._dead: CheckpointError | None = None
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._job_slot: dict[int, int] = {}
        self._slots: dict[int, tuple[torch.Tensor, str, bool]] = {}  # id -> (buffer, file, pinned)
        self._free: list[int] = []
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read_replies, name=f"shardwise-writer-replies {self.pid}",
                                        daemon=True)
        self._reader.start()
        self._finalizer = multiprocessing.util.Finalize(self, ProcessWriter._stop_at_exit,
                                                        args=(self._proc, self._jobs), exitpriority=10)

    def submit(self, plan: SavePlan, storage: Storage, tmp: str, rank: int) -> concurrent.futures.Future:
        """Copy the plan's boxes into a staging buffer and hand the writing to the writer
        process. Returns a ``Future`` of the rank's report, or of a `CheckpointError`."""
        ProcessWriter.check_storage(storage)
        storage_bytes = pickle.dumps(storage)
        starts, offset = byte_layout([p.tensor().numel() * p.tensor().element_size() for p in plan.pieces], _ALIGN)
        spans = [(p.key, tuple(p.box.offsets), tuple(p.box.sizes), p.tensor().dtype, start)
                 for p, start in zip(plan.pieces, starts)]
        job = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        slot = self._take_slot(offset) if offset else None
        if slot is not None:
            buf = self._slots[slot][0]
            try:
                with torch.no_grad():
                    for p, (_, _, sizes, dtype, start) in zip(plan.pieces, spans):
                        n = p.tensor().numel() * p.tensor().element_size()
                        view = buf[start:start + n].view(dtype).view(sizes)
                        view.copy_(p.tensor())  # the one copy: from the live tensor (GPU or CPU)
                        p.data, p.region = view, None  # the plan no longer holds the live tensor
            except BaseException:
                with self._lock:
                    self._free.append(slot)  # the buffer is not lost with the failed save
                raise
        # what `write_file` reads of the plan besides its pieces: with a reused agreement only the
        # tensors' checksums travel ([Note: reusing a save's agreement] in ``_plan_cache.py``)
        tensors = sorted(plan.meta) if plan.reused else None
        message = ("write", job, slot, spans, plan.rank_values, plan.blob_sizes, storage_bytes, tmp, rank,
                   tensors, plan.parted)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._pending[job] = future
            if slot is not None:
                self._job_slot[job] = slot
            try:
                self._jobs.send(message)
            except OSError as e:
                self._pending.pop(job)
                raise CheckpointError(f"the writer process (pid {self.pid}) of this rank does not take jobs any "
                                      f"more ({type(e).__name__}: {e}); the next save starts a new one") from None
        return future

    def _take_slot(self, nbytes: int) -> int:
        """A staging buffer of at least ``nbytes`` bytes: a free one, or a new file mapped here and
        sent to the writer. Raises the writer's death (no file is left behind, also when the writer
        dies while the file is made: its death unlinks the files of ``_slots``, this the rest)."""
        with self._lock:
            if self._dead is not None:
                raise self._dead
            fits = sorted((self._slots[s][0].numel(), s) for s in self._free if self._slots[s][0].numel() >= nbytes)
            if fits:
                self._free.remove(fits[0][1])
                return fits[0][1]
            for s in self._free:  # too small: replaced by a bigger one
                self._drop_slot(s)
            self._free = []
            slot = next(self._ids)
        size = -(-nbytes // _ROUND) * _ROUND
        path = os.path.join(_staging_dir(), f"shardwise-staging-{os.getpid()}-{slot}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                raise CheckpointError(
                    f"cannot reserve {size} bytes of staging memory in {os.path.dirname(path)} for the writer "
                    f"process ({e.strerror}); free space there or use async_checkpointer_type='thread'") from None
        finally:
            os.close(fd)
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        pinned = _pin(buf)
        with self._lock:
            if self._dead is not None:
                os.unlink(path)
                if pinned:
                    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                raise self._dead
            self._slots[slot] = (buf, path, pinned)
            try:
                self._jobs.send(("map", slot, path, size))
            except OSError:
                pass  # the next send fails with the message
        return slot

    def _drop_slot(self, slot: int) -> None:
        buf, path, pinned = self._slots.pop(slot)
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        try:
            self._jobs.send(("drop", slot))
        except OSError:
            pass

    def _read_replies(self) -> None:
        while True:
            try:
                msg = self._replies.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                if msg[0] == "mapped":
                    continue
                future = self._pending.pop(msg[1], None)
                slot = self._job_slot.pop(msg[1], None)
                if slot is not None and slot in self._slots:
                    self._free.append(slot)
            if future is None:
                continue
            if msg[0] == "done":
                future.set_result(msg[2])
            else:
                future.set_exception(CheckpointError(msg[2]))
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        dead = CheckpointError(f"the writer process (pid {self.pid}) of this rank {_exit_text(code)} while a save was "
                               "in flight; that save is not committed, and the next save starts a new writer process")
        with self._lock:
            self._dead = dead
            pending, self._pending = self._pending, {}
            for _, path, _ in self._slots.values():
                try:
                    os.unlink(path)  # not mapped by the writer yet
                except OSError:
                    pass
        for future in pending.values():
            future.set_exception(dead)

    def alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def stop(self, timeout: float = _STOP_WAIT_S) -> None:
        """Ask the writer process to finish its jobs and exit; kill it after ``timeout`` seconds."""
        self._finalizer.cancel()
        ProcessWriter._stop_at_exit(self._proc, self._jobs, timeout)
        self._reader.join(timeout)
        with ProcessWriter._start_lock:
            if ProcessWriter._current is self:
                ProcessWriter._current = None

    @staticmethod
    def _stop_at_exit(proc: subprocess.Popen, jobs: Connection, timeout: float = _STOP_WAIT_S) -> None:
        try:
            jobs.send(("stop",))
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @classmethod
    def _forget_after_fork(cls) -> None:
        """In a forked child (a data loader worker): close the inherited pipe ends, so that the
        writer process still sees end of file when the training process dies."""
        w, cls._current = cls._current, None
        cls._start_lock = threading.Lock()
        if w is not None:
            w._finalizer.cancel()
            for conn in (w._jobs, w._replies):
                try:
                    conn.close()
                except OSError:
                    pass

    @staticmethod
    def check_storage(storage: Storage) -> None:
        """Raise `CheckpointError` unless the writer process can write to ``storage``."""
        fs = getattr(storage, "fs", None)
        protocols = getattr(fs, "protocol", ())
        protocols = protocols if isinstance(protocols, (tuple, list)) else (protocols,)
        if "memory" in protocols:
            raise CheckpointError("async_checkpointer_type='process' writes from another process, which cannot "
                                  "reach this process's memory:// file system; use async_checkpointer_type='thread'")
        try:
            pickle.dumps(storage)
        except Exception as e:
            raise CheckpointError("async_checkpointer_type='process' sends the storage to the writer process, "
                                  f"but {type(storage).__name__} cannot be pickled ({e}); use "
                                  "async_checkpointer_type='thread'") from None


def _pin(buf: torch.Tensor) -> bool:
    """Register the staging buffer as pinned memory on an initialised CUDA host (faster copies
    from the GPU); not on CPU-only hosts."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    return int(err) == 0


os.register_at_fork(after_in_child=ProcessWriter._forget_after_fork)


def writer_main(job_fd: int, reply_fd: int, parent: int) -> None:
    """The writer process (see [Note: the writer process]): map buffers, write jobs, answer."""
    torch.set_num_threads(1)
    jobs, replies = Connection(job_fd, writable=False), Connection(reply_fd, readable=False)
    inbox: queue.Queue = queue.Queue()

    def receive() -> None:  # reads at once, so the training process never blocks on a full pipe
        while True:
            try:
                msg = jobs.recv()
            except (EOFError, OSError):
                os._exit(0)  # the training process is gone: no save of it can be committed
            inbox.put(msg)
            if msg[0] == "stop":
                return

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=receive, daemon=True).start()
    threading.Thread(target=watch_parent, daemon=True).start()
    buffers: dict[int, torch.Tensor] = {}
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "stop":
            os._exit(0)
        if kind == "map":
            _, slot, path, size = msg
            buffers[slot] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            try:
                os.unlink(path)
            except OSError:
                pass
            replies.send(("mapped", slot))
        elif kind == "drop":
            buffers.pop(msg[1], None)
        elif kind == "write":
            _, job, slot, spans, rank_values, blob_sizes, storage_bytes, tmp, rank, tensors, parted = msg
            try:
                replies.send(("done", job, _write_job(buffers.get(slot), spans, rank_values, blob_sizes,
                                                      storage_bytes, tmp, rank, tensors, parted)))
            except BaseException as e:
                traceback.print_exc()  # the whole story on the training process's stderr; one line in the error
                detail = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
                replies.send(("failed", job, f"the writer process (pid {os.getpid()}) failed: {detail}"))


def _write_job(buf: torch.Tensor | None, spans: list, rank_values: dict, blob_sizes: dict, storage_bytes: bytes,
               tmp: str, rank: int, tensors: list[str] | None, parted: bool) -> dict:
    """``tensors``: the tensor keys of a save whose agreement is reused (None otherwise);
    ``parted``: the boxes go to the rank's index part."""
    storage = pickle.loads(storage_bytes)
    plan = SavePlan(rank_values=rank_values, blob_sizes=blob_sizes, meta=dict.fromkeys(tensors or (), {}),
                    reused=tensors is not None, parted=parted)
    for key, offsets, sizes, dtype, start in spans:
        n = dtype.itemsize
        for s in sizes:
            n *= s
        data = torch.empty(sizes, dtype=dtype) if buf is None else buf[start:start + n].view(dtype).view(sizes)
        plan.pieces.append(Piece(key, Box(offsets, sizes), data, None))
    return _write_file(plan, storage, tmp, rank)
