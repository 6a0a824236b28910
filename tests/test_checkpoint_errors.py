"""Bad input gets one clear error on every rank, and the target stays untouched; a save killed
in the middle leaves the previous checkpoint intact and the partial one recognisably incomplete."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial

from shardwise.checkpoint import CheckpointError, load, save, verify_checkpoint
from tests._dist import RankFailure, run_ranks
from tests.test_checkpoint import app_state, build, full, train


def _save(rank, world_size, path):
    model, optim = build("fsdp2")
    train(model, optim, 1)
    save(app_state(model, optim, step=1), path)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("errors") / "good")
    run_ranks(_save, 2, path, timeout=60)
    return path


def _corrupt(good: str, root: str, case: str) -> str:
    """A copy of ``good`` damaged as ``case`` says; the damage is in the file only rank 1 reads."""
    path = os.path.join(root, case)
    if case == "nonexistent":
        return path
    if case == "empty_dir":
        os.makedirs(path)
        return path
    shutil.copytree(good, path)
    data = os.path.join(path, "rank-00001.safetensors")
    if case == "missing_file":
        os.remove(data)
    elif case in ("truncated", "truncated_no_verify"):
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) - 10)
    elif case == "checksum":
        with open(data, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif case == "bad_version":
        index = json.load(open(os.path.join(path, "index.json")))
        index["version"] = 99
        json.dump(index, open(os.path.join(path, "index.json"), "w"))
    elif case == "incomplete":
        incomplete = os.path.join(root, ".step-9.incomplete-abcd")
        os.rename(path, incomplete)
        os.remove(os.path.join(incomplete, "index.json"))
        return incomplete
    return path


CASES = {  # case -> words the message must contain
    "missing_file": ["rank-00001.safetensors", "missing", "holds tensor '"],
    "truncated": ["rank-00001.safetensors", "truncated", "holds tensor '"],
    # without checksums only rank 1 reads its file, so only rank 1 finds the damage
    "truncated_no_verify": ["rank 1:", "rank-00001.safetensors", "truncated", "holds tensor 'model/"],
    "checksum": ["rank-00001.safetensors", "checksum mismatch", "(tensor '", "corrupted"],
    "bad_version": ["every rank:", "version 99", "reads versions 1, 2"],
    "nonexistent": ["every rank:", "does not exist"],
    "empty_dir": ["every rank:", "no index.json"],
    "incomplete": ["every rank:", "incomplete save"],
    "missing_tensor": ["every rank:", "tensor 'model/extra' is not in checkpoint"],
    "wrong_shape": ["every rank:", "'model/head.weight' has shape [3, 6]", "[3, 8]"],
    "wrong_dtype": ["every rank:", "'model/scale' is torch.float32", "torch.float64"],
    "missing_value": ["every rank:", "value 'trainer/epoch' is not in checkpoint"],
}


def _bad_loads(rank, world_size, paths, good):
    out = {}
    model, optim = build("fsdp2", seed=5)  # one target for all cases: each must leave it as it was
    for case, path in paths.items():
        state = app_state(model, optim)
        source = path
        if case == "missing_tensor":
            state["model"]["extra"] = torch.zeros(2)
            source = good
        elif case == "wrong_shape":
            state["model"]["head.weight"] = torch.zeros(3, 8)
            source = good
        elif case == "wrong_dtype":
            state["model"]["scale"] = state["model"]["scale"].to(torch.float64)
            source = good
        elif case == "missing_value":
            state["trainer"]["epoch"] = 0
            source = good
        before = full(state)
        try:
            load(state, source, verify=case != "truncated_no_verify")
            out[case] = ("no error", True)
        except CheckpointError as e:
            after = full(state)
            untouched = all(torch.equal(before[k], after[k]) for k in before) and state["trainer"]["step"] == 0
            out[case] = (str(e), untouched)
    return out


def test_bad_input_raises_the_same_clear_error_on_every_rank_and_leaves_the_target(good, tmp_path):
    paths = {case: _corrupt(good, str(tmp_path), case) for case in CASES}
    per_rank = run_ranks(_bad_loads, 2, paths, good, timeout=60)
    assert per_rank[0] == per_rank[1], "both ranks raise the same message"
    for case, words in CASES.items():
        message, untouched = per_rank[0][case]
        missing = [w for w in words if w not in message]
        assert not missing, f"{case}: message lacks {missing}:\n{message}"
        assert untouched, f"{case}: the target was modified"
    assert not verify_checkpoint(paths["checksum"]).ok and verify_checkpoint(good).ok


def _bad_saves(rank, world_size, root):
    out = {}
    model, optim = build("fsdp2")
    cases = {
        "not_json": ({"x": torch.zeros(1), "when": object()}, os.path.join(root, "a")),
        "partial": ({"x": DTensor.from_local(torch.ones(2), model.head.weight.device_mesh, [Partial()])},
                    os.path.join(root, "b")),
        "not_a_checkpoint": (app_state(model, optim), root),
        "complex128": ({"z": torch.zeros(2, dtype=torch.complex128)}, os.path.join(root, "c")),
    }
    for case, (state, path) in cases.items():
        try:
            save(state, path)
            out[case] = "no error"
        except CheckpointError as e:
            out[case] = str(e)
    return out


def test_bad_save_input_is_refused_on_every_rank(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    per_rank = run_ranks(_bad_saves, 2, str(tmp_path), timeout=60)
    assert per_rank[0] == per_rank[1]
    got = per_rank[0]
    assert "'when' has type object" in got["not_json"], got["not_json"]
    assert "Partial" in got["partial"] and "Redistribute" in got["partial"], got["partial"]
    assert "refusing to replace it" in got["not_a_checkpoint"], got["not_a_checkpoint"]
    assert "'z' has dtype torch.complex128" in got["complex128"], got["complex128"]
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"], "nothing written, no temporary directory left"


# -- a rank dies in the middle of a save ---------------------------------------------------------

def _killed_save(rank, world_size, root, victim, where):
    from shardwise.checkpoint import _format
    from shardwise.checkpoint._format import _safetensors_io
    from shardwise.checkpoint import PosixStorage

    model, optim = build("fsdp2")
    save(app_state(model, optim, step=1), os.path.join(root, "step-1"))
    train(model, optim, 1)
    if rank == victim and where == "data":
        real = _safetensors_io.StreamingWriter.append

        def append_then_die(self, t):
            real(self, t)
            self._file.flush()
            os._exit(3)  # killed after writing part of its file

        _safetensors_io.StreamingWriter.append = append_then_die
    if rank == victim and where == "index":
        real_write = PosixStorage.write_atomic

        def write_half_then_die(self, path, data):
            if not path.endswith("index.json"):
                return real_write(self, path, data)  # the series record
            with open(path + ".tmp", "wb") as f:
                f.write(data[: len(data) // 2])
            os._exit(3)  # killed while writing the index

        PosixStorage.write_atomic = write_half_then_die
    save(app_state(model, optim, step=2), os.path.join(root, "step-2"))
    return _format  # not reached by the victim


@pytest.mark.parametrize("victim,where", [(1, "data"), (0, "index")])
def test_kill_during_save_keeps_previous_checkpoint_and_marks_partial(tmp_path, victim, where):
    with pytest.raises(RankFailure, match=f"rank {victim} exited with code 3"):
        run_ranks(_killed_save, 2, str(tmp_path), victim, where, timeout=30)
    assert verify_checkpoint(tmp_path / "step-1").ok, "the previous checkpoint is intact"
    assert not (tmp_path / "step-2").exists(), "the killed save never appears under its name"
    (partial,) = glob.glob(str(tmp_path / ".step-2.incomplete-*"))
    report = verify_checkpoint(partial)
    assert not report.ok and "incomplete save" in report.problems[0], report.problems
    with pytest.raises(CheckpointError, match="incomplete save"):
        load({"x": torch.zeros(1)}, partial)
    state = {"model": {"scale": torch.zeros(2)}}
    load(state, tmp_path / "step-1", strict=False)
    assert state["model"]["scale"].tolist() == [1.0, 0.5]
