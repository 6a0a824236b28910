"""Issue 12: damaged and hostile checkpoints (tests/_corrupt.py) against `load` on 2 ranks and
every CLI command. In every case: a `CheckpointError` (CLI: exit status != 0, every stderr line
one ``error: ...`` line, no traceback), the load target untouched, the damaged checkpoint and
everything outside it unchanged (no output left behind), no file outside the checkpoint opened
(inotify, any process), no file content echoed, and each call done in bounded time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.checkpoint import CheckpointError, load, main, save
from tests._corrupt import CASES, OutsideWatch
from tests._dist import run_ranks

W = torch.arange(24.0).reshape(8, 3) / 7


def _state(world_size: int, fill: float | None = None):
    w = W.clone() if fill is None else torch.full((8, 3), fill)
    if world_size > 1:
        w = distribute_tensor(w, init_device_mesh("cpu", (world_size,)), [Shard(0)])
    b = torch.arange(5.0) if fill is None else torch.full((5,), fill)
    return {"w": w, "b": b, "step": 3 if fill is None else -1}


def _save(rank, world_size, path):
    save(_state(world_size), path)


def _tree(root: str) -> dict[str, str]:
    """Every entry under ``root`` (not following links) and a hash of each regular file."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            full = os.path.join(dirpath, n)
            if os.path.islink(full):
                out[full] = "link:" + os.readlink(full)
            elif os.path.isfile(full):
                out[full] = hashlib.sha256(open(full, "rb").read()).hexdigest()
            else:
                out[full] = "dir"
    return out


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """``{case: (path, outside folder)}``, one damaged copy per case of a 2-rank checkpoint."""
    root = tmp_path_factory.mktemp("corruption")
    good = str(root / "good")
    run_ranks(_save, 2, good, timeout=60)
    out = {}
    for case, (damage, _) in CASES.items():
        base = root / case
        outside = str(base / "outside")
        os.makedirs(outside)
        shutil.copy(os.path.join(good, "rank-00001.safetensors"), os.path.join(outside, "outside.safetensors"))
        with open(os.path.join(outside, "passwd"), "w") as f:
            f.write("root:x:0:0:root:/root:/bin/bash\n")
        path = str(base / "ckpt")
        shutil.copytree(good, path)
        damage(path, outside)
        out[case] = (path, outside)
    return out


def _load_all(rank, world_size, cases):
    """Load every damaged copy on this rank; per case the message (None: no error) and whether
    the target kept its values."""
    results = {}
    for case, path in cases:
        for verify in (True, False):
            state = _state(world_size, fill=-1.0)
            start = time.monotonic()
            try:
                load(state, path, verify=verify)
                message = None
            except CheckpointError as e:
                message = str(e)
            local = state["w"].to_local()
            untouched = bool((local == -1).all() and (state["b"] == -1).all() and state["step"] == -1)
            results[f"{case}/verify={verify}"] = (message, untouched, time.monotonic() - start)
    return results


def _no_echo(message: str) -> None:
    assert "root:x" not in message and str(int.from_bytes(b"root:x:0", "little")) not in message, message


def test_load_on_two_ranks_refuses_every_damaged_checkpoint(damaged):
    before = {case: _tree(os.path.dirname(path)) for case, (path, _) in damaged.items()}
    watches = {case: OutsideWatch(outside) for case, (_, outside) in damaged.items()}
    try:
        results = run_ranks(_load_all, 2, [(c, p) for c, (p, _) in damaged.items()], timeout=120)
        for case in damaged:
            assert watches[case].count() == [], f"{case}: a file outside the checkpoint was opened"
    finally:
        for w in watches.values():
            w.close()
    for case in damaged:
        assert _tree(os.path.dirname(damaged[case][0])) == before[case], f"{case}: files changed"
    for rank, per_case in enumerate(results):
        unseen = sorted(key for key, (message, _, _) in per_case.items() if message is None)
        # without checksums a flipped data byte cannot be seen: that is what verify is for
        assert unseen == ["crc_null_plus_flip_old_index/verify=False", "data_byte_flip/verify=False"], unseen
        for key, (message, untouched, seconds) in per_case.items():
            if key in unseen:
                continue
            assert message is not None, f"rank {rank}: {key} loaded without an error"
            assert untouched, f"rank {rank}: {key}: the target was modified"
            assert seconds < 10, f"rank {rank}: {key} took {seconds:.1f} s"
            _no_echo(message)


def _cli(capsys, argv):
    start = time.monotonic()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err, time.monotonic() - start


@pytest.mark.parametrize("case", list(CASES))
def test_every_cli_command_refuses_a_damaged_checkpoint(damaged, case, capsys, tmp_path):
    path, outside = damaged[case]
    data_only = CASES[case][1]
    before = _tree(os.path.dirname(path))
    watch = OutsideWatch(outside)
    try:
        for argv in (["inspect", path], ["verify", path], ["merge", path, str(tmp_path / "merged")],
                     ["reshard", path, str(tmp_path / "resharded"), "--world-size", "3"]):
            code, err, seconds = _cli(capsys, argv)
            if argv[0] == "inspect" and data_only:
                assert code == 0, f"{case}: inspect reads no data, it should still list the checkpoint: {err}"
                continue
            assert code != 0, f"{case}: {argv[0]} exited 0"
            lines = err.splitlines()
            assert lines and all(ln.startswith("error: ") for ln in lines), f"{case}: {argv[0]}: {err}"
            assert "Traceback" not in err and seconds < 10, (case, argv[0], seconds)
            _no_echo(err)
            assert watch.count() == [], f"{case}: {argv[0]} opened a file outside the checkpoint"
        assert not os.path.lexists(tmp_path / "merged") and not os.path.lexists(tmp_path / "resharded")
        assert [n for n in os.listdir(tmp_path) if "incomplete" in n] == [], os.listdir(tmp_path)
    finally:
        watch.close()
    assert _tree(os.path.dirname(path)) == before, f"{case}: files changed"


def test_cli_on_the_good_checkpoint_and_merge_outputs(tmp_path, capsys):
    """The same commands on an undamaged copy succeed (the suite is not refusing everything)."""
    path = str(tmp_path / "good")
    run_ranks(_save, 2, path, timeout=60)
    assert _cli(capsys, ["inspect", path])[0] == 0
    assert _cli(capsys, ["verify", path])[0] == 0
    assert _cli(capsys, ["merge", path, str(tmp_path / "m")])[0] == 0
    assert _cli(capsys, ["reshard", path, str(tmp_path / "r"), "--world-size", "3"])[0] == 0
    state = _state(1, fill=-1.0)
    load(state, str(tmp_path / "r"))
    assert torch.equal(state["w"], W) and state["step"] == 3
