"""benchmarks/tracker.py counts live storages once, at their current size, on a known sequence;
benchmarks/gpu_step.py runs its code path on CPU (its smoke mode) and says so without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tracker import AllocationTracker
from tests._dist import run_ranks


def test_known_allocation_sequence():
    state = torch.zeros(1000)  # 4000 bytes that exist before tracking
    tracker = AllocationTracker()
    tracker.track([state, None], "state")
    assert tracker.current() == 4000 and tracker.peak == 4000
    with tracker:
        tracker.phase = "a"
        b = torch.empty(250)  # +1000
        view = b.view(50, 5)  # same storage: counted once
        assert tracker.current() == 5000
        del b, view  # storage dies -> no longer counted
        assert tracker.current() == 4000
        tracker.phase = "b"
        d = torch.ones(500)  # +2000 -> 6000
        assert tracker.peak == 6000 and tracker.peak_phase == "b"
        d.untyped_storage().resize_(0)  # freed in place, as fully_shard frees unsharded params
        e = torch.zeros(100)  # +400; d counts 0 now
        assert tracker.current() == 4400 and tracker.peak == 6000
        tracker.phase = "c"
        d.untyped_storage().resize_(2000)  # re-grown in place, then written
        d.fill_(1.0)
        assert tracker.peak == 6400 and tracker.peak_phase == "c"
        assert tracker.peak_by_tag == {"state": 4000, "new": 2400}
        del e
    assert tracker.current() == 6000
    x = torch.zeros(10_000)  # outside the tracker: not seen
    assert tracker.current() == 6000 and x.numel()
    tracker.reset_peak()
    assert tracker.peak == 6000


def test_autograd_saved_tensors_and_grads_are_counted():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64, generator=g))
    x = torch.randn(8, 64, generator=g)
    tracker = AllocationTracker()
    tracker.track([w, x])
    with tracker:
        (x @ w).tanh().sum().backward()  # saves tanh's output, creates w.grad
    assert tracker.current() == 2 * 64 * 64 * 4 + 8 * 64 * 4  # w, w.grad, x; the rest is freed
    assert tracker.peak >= tracker.current() + 8 * 64 * 4  # tanh output saved until backward


def _dtensor_inner(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.zeros(8, 4)
    tracker = AllocationTracker()
    with tracker:
        dt = distribute_tensor(full, mesh, [Shard(0)])
        base = tracker.current()
        y = dt * 2  # a DTensor output: its local tensor is counted
        grew = tracker.current() - base
    return grew, y.to_local().numel() * 4


def test_dtensors_count_their_local_tensors():
    for grew, local_bytes in run_ranks(_dtensor_inner, 2):
        assert grew == local_bytes == 4 * 4 * 4, (grew, local_bytes)


# -- benchmarks/gpu_step.py: its code path on CPU (no GPU here) --------------------------------------
def _gpu_step_smoke(rank, world_size):
    import contextlib
    import io

    from benchmarks import gpu_step

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_step.main(["--device", "cpu", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
                            "--seq-len", "16", "--batch-per-rank", "2", "--steps", "1", "--reps", "2"])
    return rc, out.getvalue()


def test_gpu_step_benchmark_runs_its_code_path_on_cpu():
    """The GPU benchmark's CPU smoke mode on 2 gloo ranks: both implementations train the same
    steps (the loss difference it prints is ~0) and the report is printed on rank 0."""
    (rc0, out0), (rc1, out1) = run_ranks(_gpu_step_smoke, 2, timeout=120)
    assert rc0 == rc1 == 0
    assert out1 == ""
    assert "| shardwise |" in out0 and "| torch FSDP2 |" in out0, out0
    assert "offload check (code path only, cpu host): ok" in out0, out0
    diff = float(out0.rsplit("at equal steps:", 1)[1].split()[0])
    assert diff < 1e-5, out0


def test_gpu_step_benchmark_without_cuda_says_so(capsys):
    import torch

    from benchmarks import gpu_step

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: gpu_step.py would run the real benchmark")
    assert gpu_step.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().err
