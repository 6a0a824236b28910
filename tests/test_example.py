"""The main job (examples/train.py) trains exactly like one process on the global batch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.data import global_batch, inputs_and_targets
from examples.model import Llama, LlamaConfig
from tests._dist import run_ranks

ARGS = ["--steps", "4", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64",
        "--seq-len", "16", "--batch-size", "8", "--log-every", "100"]


ROOT = Path(__file__).resolve().parent.parent


def _main_job(rank, world_size, argv):
    from examples.train import main

    return main(argv)


def _main_job_output(rank, world_size, argv):
    """``(losses, what the rank printed)``."""
    from examples.train import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = main(argv)
    return losses, out.getvalue()


def _reference_losses(steps=4, dim=32, layers=2, heads=4, vocab=64, seq_len=16, batch=8, lr=3e-3, seed=0,
                      prepare=None):
    """The example's losses in one process; ``prepare(model, optim)`` runs before the first step."""
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                      max_seq_len=max(seq_len, LlamaConfig.max_seq_len))
    model = Llama(cfg, generator=torch.Generator().manual_seed(seed))
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    if prepare is not None:
        prepare(model, optim)
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = inputs_and_targets(global_batch(step, batch, seq_len, vocab, seed))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "world_size,extra",
    [(2, []), (4, ["--dp-replicate", "2"]), (4, ["--tp", "2"])],
    ids=["fsdp2", "hsdp2x2", "fsdp2xtp2"],
)
def test_main_job_matches_single_process(world_size, extra):
    ref = _reference_losses()
    for rank, losses in enumerate(run_ranks(_main_job, world_size, ARGS + extra, timeout=120)):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: {a} vs reference {b}"
        assert losses[-1] < losses[0], "the loss falls"


@pytest.mark.parametrize("extra", [[], ["--pp", "2"], ["--cp", "2"]], ids=["plain", "pp2", "cp2"])
def test_every_path_ends_with_the_same_result_line(extra):
    """The plain, pipelined and context-parallel paths end alike: rank 0's last line is
    ``result: steps=S trained=T samples=N loss=L`` with the last step's loss exactly; the
    other rank prints nothing."""
    from examples.elastic import parse_result

    (losses, out0), (_, out1) = run_ranks(_main_job_output, 2, ARGS + extra, timeout=180)
    assert len(losses) == 4, losses
    last = out0.rstrip().splitlines()[-1]
    assert last.startswith("result: "), out0
    assert parse_result(out0) == {"steps": 4, "trained": 4, "samples": 32, "loss": losses[-1]}, last
    assert out1 == "", out1


def _hint_argv(text: str, world_size: int) -> list[str]:
    """The arguments of the resume command rank 0 printed after ``--save``, checked to be a
    torchrun command line of examples/train.py."""
    m = re.search(r"resume \(on any world size\) with: (.*)", text)
    assert m, f"no resume command in the output:\n{text}"
    cmd = shlex.split(m.group(1))
    assert cmd[:4] == ["torchrun", "--nproc-per-node", str(world_size), "examples/train.py"], cmd
    return cmd[4:]


def test_stop_on_four_ranks_and_resume_on_two(tmp_path, monkeypatch):
    """--save on a 4-rank FSDP run prints a resume command; that command, run as printed on 2
    ranks (another layout), trains the remaining steps exactly as uninterrupted training on one
    process. Save and load report bytes and seconds; ms/step counts only the steps trained; a
    resume with nothing left to do says so and builds nothing."""
    monkeypatch.chdir(ROOT)  # the command names examples/train.py relative to the repo root
    ref = _reference_losses(steps=6)
    ckpt = str(tmp_path / "ckpt")
    first = ARGS[2:]  # drop "--steps 4"
    saved, out = run_ranks(_main_job_output, 4, ["--steps", "3", "--save", ckpt] + first, timeout=120)[0]
    size = sum(f.stat().st_size for f in Path(ckpt).iterdir())
    assert re.search(rf"saved step 3 to {re.escape(ckpt)}: {size} bytes in \d+\.\d+s", out), out
    argv = _hint_argv(out, 4)
    assert argv[argv.index("--steps") + 1] == "6", argv  # --steps is the total: the hint asks for 3 more
    resumed, out2 = run_ranks(_main_job_output, 2, argv, timeout=120)[0]
    assert len(saved) == 3 and len(resumed) == 3, (len(saved), len(resumed))
    for step, (a, b) in enumerate(zip(saved + resumed, ref), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs reference {b}"
    assert re.search(rf"loaded step 3 from {re.escape(ckpt)}: \d+ bytes read by 2 ranks in \d+\.\d+s", out2), out2
    assert "training steps 4..6 (3 steps)" in out2, out2
    assert re.search(r"train \d+\.\ds \(3 steps, \d+ ms/step\)", out2), out2

    # nothing left: one line with the command that trains more, no process group, no model
    import examples.train as train

    monkeypatch.setattr(train, "init_distributed", _must_not_run)
    monkeypatch.setattr(train, "build_and_shard", _must_not_run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(["--steps", "3", "--resume", ckpt] + first) == []
    text = printed.getvalue()
    assert "is at step 3 and --steps 3 is the total: nothing left to train" in text, text
    assert text.count("\n") == 1, text
    again = shlex.split(text.split("run: ", 1)[1])
    assert again[again.index("--steps") + 1] == "6" and again[again.index("--resume") + 1] == ckpt, again

    # other model shapes than the checkpoint's: refused before building, naming the value
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        train.main(["--steps", "6", "--resume", ckpt] + first + ["--dim", "64"])  # the last --dim wins
    assert exc.value.code == 2, exc.value.code
    assert "holds a model with --dim 32, not 64; pass --dim 32" in err.getvalue(), err.getvalue()


def _must_not_run(*args, **kwargs):
    raise AssertionError("built something before the arguments were checked")


def _hf_folder(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")


def _incomplete(path: Path) -> Path:
    bad = path.parent / f".{path.name}.incomplete-0a1b"
    bad.mkdir()
    (bad / "rank-00000.safetensors").write_bytes(b"")
    return bad


@pytest.mark.parametrize("argv,make,expect", [
    (["--batch-size", "10"], None, "valid --batch-size values: multiples of 4, e.g. 8 or 12"),
    (["--tp", "3"], None, "--tp 3 does not divide the world size 4; valid --tp values on 4 ranks: 1, 2, 4"),
    (["--dp-replicate", "2", "--dp-shard", "4"], None, "valid --dp-shard values here: 2 or -1"),
    (["--resume", "{d}/none"], None, "--resume {d}/none: does not exist"),
    (["--resume", "{d}/empty"], lambda p: p.mkdir(), "is an empty folder"),
    (["--resume", "{d}/hf"], _hf_folder, "is a Hugging Face folder"),
    (["--resume", "{d}/.ck.incomplete-0a1b"], lambda p: _incomplete(p.parent / "ck"), "is an incomplete save"),
    (["--resume", "{d}/ck"], lambda p: _incomplete(p), "a save to it stopped before committing (.ck.incomplete-0a1b"),
    (["--pp", "3"], None, "--pp 3 does not divide the world size 4; valid --pp values: 1, 2, 4"),
    (["--pp", "4", "--layers", "2"], None, "--layers 2 is fewer than the 4 pipeline stages"),
    (["--pp", "2", "--batch-size", "12"], None, "data-parallel size 2 x microbatches 4; valid --batch-size values: "
                                                "multiples of 8, e.g. 8 or 16"),
], ids=["batch", "tp3", "dp-shard", "resume-missing", "resume-empty", "resume-hf", "resume-incomplete",
        "resume-uncommitted", "pp3", "pp-layers", "pp-microbatches"])
def test_bad_arguments_one_line_before_building(argv, make, expect, tmp_path, monkeypatch, capsys):
    """Each mistake: one line on stderr naming the valid values, exit status 2, checked with the
    world size torchrun announces (WORLD_SIZE) before any process group or model exists."""
    import examples.train as train

    monkeypatch.setattr(train, "init_distributed", _must_not_run)
    monkeypatch.setattr(train, "build_and_shard", _must_not_run)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    argv = [a.format(d=tmp_path) for a in argv]
    if make is not None:
        make(Path(argv[-1]))
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("train.py: error: "), (out, err)
    assert expect.format(d=tmp_path) in err, err


def test_bad_argument_in_a_real_process_is_one_line_on_rank_0_only():
    """As torchrun starts it: rank 0 prints one line and no traceback, rank 1 prints nothing;
    both exit 2."""
    procs = [subprocess.Popen([sys.executable, "examples/train.py", "--tp", "3"], cwd=ROOT, text=True,
                              env=dict(os.environ, WORLD_SIZE="4", RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    for rank, (proc, lines) in enumerate(zip(procs, (1, 0))):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (rank, proc.returncode, err)
        assert out == "" and err.count("\n") == lines, (rank, err)
        assert "Traceback" not in err


def test_help_shows_every_option_with_help_and_default():
    from examples.train import build_parser

    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help text"
        assert f"(default: {action.default})" in " ".join(text.split()), f"{action.option_strings}: no default shown"


def test_torchrun_save_then_printed_command_without_numpy(tmp_path):
    """The real CLI, as a user runs it, in processes where ``import numpy`` fails (numpy is no
    dependency): a 2-rank ``--save`` finishes, and the resume command it prints, run as
    printed (plus ``--standalone`` for a free port), trains the remaining steps."""
    blocker = tmp_path / "blocker" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError('numpy is blocked here', name='numpy')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), str(ROOT)]))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ckpt = str(tmp_path / "ckpt")
    small = ["--dim", "32", "--vocab", "64", "--seq-len", "16", "--batch-size", "4", "--log-every", "100"]
    first = subprocess.run(launch + ["--nproc-per-node", "2", "examples/train.py", "--steps", "2", "--save", ckpt]
                           + small, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "saved step 2 to" in first.stdout and not list(tmp_path.glob(".ckpt.incomplete-*")), first.stdout
    cmd = shlex.split(re.search(r"resume \(on any world size\) with: (.*)", first.stdout).group(1))
    assert cmd[0] == "torchrun", cmd
    second = subprocess.run(launch + cmd[1:], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "training steps 3..4 (2 steps)" in second.stdout, second.stdout
    json.loads((Path(ckpt) / "index.json").read_text())  # still the complete checkpoint


@pytest.mark.parametrize("argv", [["--cp", "2", "--experts", "4"], ["--checkpoint-dir", "ck", "--pp", "2"],
                                  ["--checkpoint-dir", "ck", "--experts", "4"],
                                  ["--cp", "2", "--pp", "2", "--experts", "4"],
                                  ["--ft-replica-group", "0", "--pp", "2"]])
def test_paths_that_do_not_combine_are_refused_not_ignored(argv, monkeypatch, capsys, tmp_path):
    """--checkpoint-dir, --pp, --cp and --experts are separate loops of the example: two at once
    is one error before anything is built, not one of them silently dropped."""
    from examples.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "do not combine" in capsys.readouterr().err
