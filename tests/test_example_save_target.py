"""Issue 20 item 7: ``examples/train.py --save`` checks its target before step 1 (one line, exit
status 2, nothing built), and a save that fails after training keeps the weights (saved to a
temporary folder it names)."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from shardwise.checkpoint import verify_checkpoint
from tests._dist import run_ranks


def _must_not_run(*args, **kwargs):
    raise AssertionError("built something before --save was checked")


def _user_folder(p: Path) -> None:
    p.mkdir()
    (p / "notes.txt").write_text("mine")


def _under_a_file(p: Path) -> None:
    p.parent.write_text("a file")


@pytest.mark.parametrize("target,make,expect", [
    ("{d}/mine", _user_folder, "is not a shardwise checkpoint; refusing to replace it"),
    ("{d}/file/ck", _under_a_file, "is a file, not a folder"),
    ("{d}/link", lambda p: p.symlink_to(p.parent), "is a symbolic link"),
    ("/proc/shardwise-ck", None, "is not writable"),
], ids=["user-folder", "under-a-file", "symlink", "unwritable"])
def test_a_bad_save_target_is_one_line_before_anything_is_built(target, make, expect, tmp_path, monkeypatch,
                                                                capsys):
    import examples.train as train

    monkeypatch.setattr(train, "init_distributed", _must_not_run)
    monkeypatch.setattr(train, "build_and_shard", _must_not_run)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    target = target.format(d=tmp_path)
    if make is not None:
        make(Path(target))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as exc:
        train.main(["--steps", "1", "--save", target])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"train.py: error: --save {target}: "), (out, err)
    assert expect in err, err
    assert sorted(os.listdir(tmp_path)) == before, "the check left nothing behind"


def _save_fails_once(rank, world_size, argv):
    import examples.train as train

    real = train.ckpt.save
    calls = []

    def failing(state, path, **kw):
        calls.append(path)
        if len(calls) == 1:
            raise train.ckpt.CheckpointError(f"saving checkpoint {path} failed on rank 0: OSError: No space left")
        return real(state, path, **kw)

    train.ckpt.save = failing
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = train.main(argv)
    return losses, out.getvalue()


def test_a_save_that_fails_after_training_keeps_the_weights(tmp_path):
    argv = ["--steps", "2", "--dim", "32", "--layers", "1", "--heads", "4", "--vocab", "64", "--seq-len", "16",
            "--batch-size", "4", "--save", str(tmp_path / "ck")]
    (losses, out), _ = run_ranks(_save_fails_once, 2, argv, timeout=120)
    assert len(losses) == 2
    m = re.search(r"could not save to (\S+) \(.*No space left.*\); saving to (\S+) instead", out)
    assert m and m.group(1) == str(tmp_path / "ck"), out
    rescued = m.group(2)
    try:
        assert f"saved step 2 to {rescued}" in out and f"--resume {rescued}" in out, out
        assert verify_checkpoint(rescued).fully_checked
    finally:
        import shutil
        shutil.rmtree(os.path.dirname(rescued), ignore_errors=True)
