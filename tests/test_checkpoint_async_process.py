"""async_save(async_checkpointer_type="process"): the writer process of each rank ([Note: the
writer process] in checkpoint/_save/_process_writer.py): bit-exact round trips, saves in
flight in order, a killed writer surfacing on every rank with nothing committed, DCP's call
form, and no writer process outliving its training process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

import shardwise.checkpoint as ck
from shardwise.checkpoint._save._process_writer import ProcessWriter
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, build, full, train

TIMEOUT = 180.0  # a writer process imports torch: seconds on a loaded machine


def _gone(pid: int, within: float = 20.0) -> bool:
    """Whether process ``pid`` has exited (a zombie waiting for its reaper counts) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(line.startswith("State:") and "Z" in line for line in f):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _writer_pid() -> int:
    w = ProcessWriter._current
    assert w is not None and w.alive(), "no running writer process"
    return w.pid


def _states_equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        (torch.equal(got[k], v) and got[k].dtype == v.dtype) if isinstance(v, torch.Tensor) else got[k] == v
        for k, v in want.items())


def _mixed_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "t": torch.randn(40, 30, generator=g).t(),  # not contiguous
            "bf": torch.randn(33, generator=g).to(torch.bfloat16), "i": torch.randint(-9, 9, (17,), generator=g),
            "mask": torch.rand(11, generator=g) > 0.5, "empty": torch.empty(0, 5), "step": seed,
            "blob": bytes(range(seed % 7, 200))}


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else (b"" if isinstance(v, bytes) else 0)
            for k, v in state.items()}


def test_round_trip_bit_exact_and_saves_in_flight_in_order(tmp_path):
    states = [_mixed_state(s) for s in (1, 2, 3)]
    handles = [ck.async_save(s, tmp_path / f"step-{i}", async_checkpointer_type="process", keep_last=2)
               for i, s in enumerate(states)]  # three saves in flight at once
    pid = _writer_pid()
    assert pid != os.getpid() and [h.async_checkpointer_type for h in handles] == ["process"] * 3
    for s in states:  # the snapshot was taken at return: later changes are not saved
        s["w"].add_(1.0)
    said = [h.result(timeout=TIMEOUT) for h in handles]  # committed in order; keep_last rotates step-0 away
    assert said[2] and "step-0" in " ".join(said[2]), said
    assert sorted(os.listdir(tmp_path)) == [".shardwise-series.json", "step-1", "step-2"]
    for i in (1, 2):
        want = _mixed_state(i + 1)
        got = _zeros_like(want)
        ck.load(got, tmp_path / f"step-{i}")
        assert _states_equal(got, want), f"step-{i} differs"
        assert ck.verify_checkpoint(tmp_path / f"step-{i}").ok
    again = ck.async_save(states[0], tmp_path / "step-3", async_checkpointer_type="process")
    again.result(timeout=TIMEOUT)
    assert _writer_pid() == pid, "the writer process is reused from save to save"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shardwise-staging-{os.getpid()}-")], \
        "the staging files are unlinked once the writer has mapped them"
    ProcessWriter.shutdown()
    assert _gone(pid) and ProcessWriter._current is None


def test_the_order_of_saves_in_flight(tmp_path):
    """The writer writes jobs in the order of the saves: a later one is never done first."""
    big = {"w": torch.randn(4_000_000)}
    first = ck.async_save(big, tmp_path / "a", async_checkpointer_type="process")
    second = ck.async_save({"w": torch.ones(3)}, tmp_path / "b", async_checkpointer_type="process")
    while not second.done():
        time.sleep(0.001)
    assert first.done(), "the second save finished before the first"
    second.result(timeout=TIMEOUT)  # the commits may come in any order: each is its own checkpoint
    first.result(timeout=TIMEOUT)
    got = {"w": torch.zeros(4_000_000)}
    ck.load(got, tmp_path / "a")
    assert torch.equal(got["w"], big["w"])


def _fsdp_round_trip(rank, world_size, path):
    model, optim = build("fsdp2")
    train(model, optim, 1)
    state = app_state(model, optim, step=1)
    want = full(state)
    handle = ck.async_save(state, path, async_checkpointer_type="process")
    with torch.no_grad():  # change everything in place once async_save returned
        for p in model.parameters():
            p.to_local().add_(1.0)
    state["trainer"]["step"] = 99
    handle.result(timeout=TIMEOUT)
    model2, optim2 = build("fsdp2", seed=9)
    state2 = app_state(model2, optim2)
    ck.load(state2, path)
    return full(state2), want, state2["trainer"]["step"], _writer_pid()


def test_fsdp_state_round_trips_bit_exact_over_two_ranks(tmp_path):
    out = run_ranks(_fsdp_round_trip, 2, str(tmp_path / "a"), timeout=TIMEOUT)
    for rank, (got, want, step, _) in enumerate(out):
        assert_equal_states(got, want, f"rank {rank}")
        assert step == 1
    for _, _, _, pid in out:  # the ranks have exited: so have their writer processes
        assert _gone(pid), f"writer process {pid} outlived its rank"


def _killed_writer(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full_w = torch.arange(2 * 8_000_000, dtype=torch.float32)
    state = {"w": distribute_tensor(full_w, mesh, [Shard(0)]), "step": 5}
    warm = ck.async_save(state, f"{path}/warm", async_checkpointer_type="process")
    warm.result(timeout=TIMEOUT)  # both writer processes are up
    first_pid = _writer_pid()
    handle = ck.async_save(state, f"{path}/step-1", async_checkpointer_type="process")
    partial = None
    if rank == 1:  # kill the writer once its file has begun, before it is complete
        from shardwise.checkpoint._format import data_file_name

        data = os.path.join(handle._tmp, data_file_name(1))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not (os.path.exists(data) and os.path.getsize(data) > 0):
            time.sleep(0.0005)
        assert os.path.exists(data), f"{data} never appeared"
        os.kill(first_pid, signal.SIGSTOP)
        partial = os.path.getsize(data) < 8_000_000 * 4
        os.kill(first_pid, signal.SIGKILL)
    try:
        handle.result(timeout=TIMEOUT)
        message = "no error"
    except ck.CheckpointError as e:
        message = str(e)
    torch.distributed.barrier()  # rank 0 has deleted the temporary folder
    listing = sorted(os.listdir(path))
    again = ck.async_save(state, f"{path}/step-2", async_checkpointer_type="process")
    again.result(timeout=TIMEOUT)  # the next save starts a new writer process
    got = {"w": distribute_tensor(torch.zeros_like(full_w), mesh, [Shard(0)]), "step": 0}
    ck.load(got, f"{path}/step-2")
    ok = torch.equal(got["w"].full_tensor(), full_w) and got["step"] == 5
    return message, partial, listing, first_pid, _writer_pid(), ok


def test_a_killed_writer_process_fails_the_save_on_every_rank_and_commits_nothing(tmp_path):
    out = run_ranks(_killed_writer, 2, str(tmp_path), timeout=TIMEOUT)
    messages = [o[0] for o in out]
    assert messages[0] == messages[1], messages
    assert "rank 1: the writer process" in messages[0] and "was killed by SIGKILL" in messages[0], messages[0]
    assert out[1][1] is True, "the writer was killed after its file had begun and before it was complete"
    for message, _, listing, first, second, ok in out:
        assert listing == [".shardwise-series.json", "warm"], f"nothing of step-1 is left: {listing}"
        assert ok, "the save after the failure round-trips"
    assert out[1][3] != out[1][4], "rank 1 got a new writer process"
    assert out[0][3] == out[0][4], "rank 0 kept its writer process"
    for o in out:
        assert _gone(o[3]) and _gone(o[4]), "a writer process outlived its rank"


class _CountCopies(TorchFunctionMode):
    """Bytes written by ``Tensor.copy_`` and bytes of tensors allocated by ``torch.empty`` while
    active (on this thread: the training process's part of an ``async_save``)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = self.allocated = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_:
            self.copied += out.numel() * out.element_size()
        elif func is torch.empty:
            self.allocated += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_async_save_copies_each_box_once(tmp_path, kind):
    """The training process copies the state once: with "process" straight from the live
    tensors into the staging buffer (no snapshot allocated before it); with "thread" into the
    snapshot. A second copy (a snapshot, then the staging buffer) doubles ``copied``."""
    state = _mixed_state(5)
    box_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    box_bytes += len(state["blob"])  # saved as a uint8 box
    ck.async_save(state, tmp_path / "warm", async_checkpointer_type=kind).result(timeout=TIMEOUT)  # buffers made
    with _CountCopies() as counted:
        handle = ck.async_save(state, tmp_path / "step-1", async_checkpointer_type=kind)
    if kind == "process":
        buffers = {buf.untyped_storage().data_ptr() for buf, _, _ in ProcessWriter._current._slots.values()}
        assert all(p.tensor().untyped_storage().data_ptr() in buffers for p in handle._plan.pieces), \
            "a box of the save is not in the staging buffer"
    assert counted.copied == box_bytes, f"{kind}: copied {counted.copied} bytes for {box_bytes} bytes of boxes"
    assert counted.allocated == (0 if kind == "process" else box_bytes), (kind, counted.allocated)
    state["w"].add_(1.0)  # after the call: not saved
    handle.result(timeout=TIMEOUT)
    want, got = _mixed_state(5), _zeros_like(state)
    ck.load(got, tmp_path / "step-1")
    assert _states_equal(got, want)
    ProcessWriter.shutdown()


def test_dcp_call_form_thread_and_process(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = _mixed_state(4)
    for kind, given in [("thread", AsyncCheckpointerType.THREAD), ("process", AsyncCheckpointerType.PROCESS),
                        ("process", "PROCESS"), ("thread", None)]:
        handle = ck.async_save(state, checkpoint_id=str(tmp_path / f"{kind}-{given}"), async_checkpointer_type=given)
        assert handle.async_checkpointer_type == kind, (given, handle.async_checkpointer_type)
        assert handle.result(timeout=TIMEOUT) == [] and handle.done() and handle.staging_completion.done()
        got = _zeros_like(state)
        ck.load(got, checkpoint_id=str(tmp_path / f"{kind}-{given}"))
        assert _states_equal(got, state), (kind, given)
    after = ck.async_save(state, tmp_path / "default")  # a kind never carries over to the next save
    assert after.async_checkpointer_type == "thread"
    after.result()
    with pytest.raises(ValueError, match="'thread' or 'process'"):
        ck.async_save(state, tmp_path / "bad", async_checkpointer_type="gpu")
    assert not os.path.exists(tmp_path / "bad")
    ProcessWriter.shutdown()


def test_an_error_in_the_writer_process_fails_the_save_and_the_writer_goes_on(tmp_path):
    first = ck.async_save({"w": torch.ones(3)}, tmp_path / "warm", async_checkpointer_type="process")
    first.result(timeout=TIMEOUT)
    pid = _writer_pid()
    os.kill(pid, signal.SIGSTOP)  # the job waits while its temporary folder is taken away
    try:
        handle = ck.async_save({"w": torch.ones(3)}, tmp_path / "step-1", async_checkpointer_type="process")
        os.rmdir(handle._tmp)
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(ck.CheckpointError, match=r"the writer process \(pid \d+\) failed: FileNotFoundError") as e:
        handle.result(timeout=TIMEOUT)
    assert "\n" not in str(e.value).split("failed:", 1)[1].strip(), str(e.value)
    assert sorted(os.listdir(tmp_path)) == [".shardwise-series.json", "warm"]
    again = ck.async_save({"w": torch.full((3,), 2.0)}, tmp_path / "step-2", async_checkpointer_type="process")
    again.result(timeout=TIMEOUT)
    assert _writer_pid() == pid, "a failed job does not end the writer process"
    ProcessWriter.shutdown()


def test_process_mode_refuses_a_memory_file_system():
    handle = ck.async_save({"w": torch.ones(2)}, "memory://shardwise-test/a", async_checkpointer_type="process")
    with pytest.raises(ck.CheckpointError, match="memory:// file system; use async_checkpointer_type='thread'"):
        handle.result(timeout=TIMEOUT)


_CHILD = textwrap.dedent("""
    import os, sys, torch
    import shardwise.checkpoint as ck
    from shardwise.checkpoint._save._process_writer import ProcessWriter
    h = ck.async_save({"w": torch.ones(4)}, sys.argv[1], async_checkpointer_type="process")
    h.result()
    print(os.getpid(), ProcessWriter._current.pid, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), 9)
    if sys.argv[2] == "forget":
        ck.async_save({"w": torch.ones(4)}, sys.argv[1] + "-never", async_checkpointer_type="process")
""")


@pytest.mark.parametrize("end", ["exit", "kill", "forget"])
def test_no_writer_process_outlives_its_training_process(tmp_path, end):
    """At a normal exit (also with a save never waited for) the writer is stopped; when the
    training process is killed, the writer sees its pipe close and exits."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: a lingering writer would hold a pipe open
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "a"), end], stdout=o, stderr=e,
                              timeout=TIMEOUT)
    assert proc.returncode == (-9 if end == "kill" else 0), err.read_text()
    trainer, pid = map(int, out.read_text().split()[:2])
    gone = _gone(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, f"the writer process {pid} outlived its training process ({end})"
    if end == "forget":
        assert "was never waited for" in err.read_text() and not os.path.exists(tmp_path / "a-never")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shardwise-staging-{trainer}-")], \
        "a staging file was left in /dev/shm"


def test_a_dead_writer_takes_no_staging_buffer(tmp_path):
    """A save that reaches a writer process which has died gets its death as the error, and no
    staging file is made for it (one made then would outlive everything: nobody maps it)."""
    ck.async_save({"w": torch.ones(3)}, tmp_path / "a", async_checkpointer_type="process").result(timeout=TIMEOUT)
    w = ProcessWriter._current
    assert w is not None
    os.kill(w.pid, signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT
    while w._dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w._dead is not None, "the writer's death was not noticed"
    with pytest.raises(ck.CheckpointError, match="writer process .* was killed by SIGKILL"):
        w._take_slot(1 << 16)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shardwise-staging-{os.getpid()}-")], \
        "a staging file was made for a dead writer"
