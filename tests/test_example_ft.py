"""The main job under torchft: ``examples/train.py --ft-replica-group G --ft-lighthouse URL``,
two replica groups of 2 ranks (torchrun each, as docs/fault_tolerance.md launches them) and a
lighthouse on 127.0.0.1 started and stopped here. ``--ft-min-groups 2``: no step commits without
both groups (the first waits for the later one). With both groups in every step the job trains
as one process on the global batch: the mean of the two groups' losses is the single-process
loss (1e-5 relative: the cross-group average is a float32 all-reduce of the two groups' means).
The one process makes the same calls as a group: it takes ``get_optimizer_state_dict`` once
before training (the state the Manager serves), which, in torch's DCP as in shardwise, creates
AdamW's state with one zero step (``step`` = 1 before the first update)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from examples.elastic import parse_result
from tests.compat._torchft_groups import ROOT, free_port, lighthouse_binary, start_lighthouse, stop
from tests.test_example import ARGS, _reference_losses

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
                                reason="torchft (with its torchft_lighthouse) is not installed")


def _one_process_losses():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return _reference_losses(prepare=get_optimizer_state_dict)  # the served state: AdamW's state made by a zero step


def test_two_replica_groups_and_a_lighthouse_train_as_one_process(tmp_path):
    lighthouse, url = start_lighthouse(tmp_path)
    procs, logs = [], []
    try:
        for g in (0, 1):
            logs.append(tmp_path / f"group{g}.log")
            with open(logs[-1], "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "examples/train.py",
                     *ARGS, "--ft-replica-group", str(g), "--ft-groups", "2", "--ft-min-groups", "2", "--ft-lighthouse", url],
                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")))
        for p in procs:
            p.wait(timeout=400)
        text = [log.read_text() for log in logs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(text)
    finally:
        for p in procs:
            stop(p)
        stop(lighthouse)
    results = [parse_result(t) for t in text]
    ref = _one_process_losses()
    assert all(r["steps"] == 4 and r["trained"] == 4 for r in results), results
    mean = (results[0]["loss"] + results[1]["loss"]) / 2
    assert abs(mean - ref[-1]) <= 1e-5 * abs(ref[-1]), (mean, ref[-1], "\n".join(text))
    assert all("groups 2" in t for t in text), "\n".join(text)
