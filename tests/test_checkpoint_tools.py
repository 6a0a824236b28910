"""The command line (inspect, verify, merge, reshard), Hugging Face files and full state dicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from shardwise.checkpoint import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    load,
    load_safetensors,
    main,
    save,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from tests._dist import run_ranks
from tests.test_checkpoint import (
    _save_mixed,
    app_state,
    assert_equal_states,
    build,
    full,
    mixed_full,
    train,
)


def _save_fsdp4(rank, world_size, path):
    model, optim = build("fsdp4")
    train(model, optim, 1)
    state = app_state(model, optim, step=1)
    save(state, path)
    got = full(state)  # collective
    return got if rank == 0 else None


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tools") / "fsdp4")
    return path, run_ranks(_save_fsdp4, 4, path, timeout=60)[0]


def test_inspect_and_verify(fsdp4, capsys):
    path, want = fsdp4
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "saved by 4 ranks" in out and "mesh 4 ('dp_shard',) Shard(dim=0)" in out, out
    assert "model/head.weight" in out and "plain values: optim/param_groups, trainer/name, trainer/step" in out, out
    assert main(["inspect", path, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["saved_from_world_size"] == 4 and summary["tensors"]["model/head.weight"]["boxes"] == 3
    assert set(summary["tensors"]) == set(want)
    assert main(["verify", path]) == 0 and capsys.readouterr().out.startswith("OK ")
    assert main(["verify", os.path.dirname(path)]) == 1 and "no index.json" in capsys.readouterr().err
    cmd = [sys.executable, "-m", "shardwise.checkpoint", "verify", path]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("OK "), done.stderr


def test_merge_to_hugging_face_files_matches_the_full_state(fsdp4, tmp_path):
    path, want = fsdp4
    out = tmp_path / "hf"
    assert main(["merge", path, str(out), "--prefix", "model/", "--max-shard-size", "300B", "--no-progress"]) == 0
    index = json.loads((out / "tensors.safetensors.index.json").read_text())  # no --config: bare tensors
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"tensors-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for f in files:
        merged.update(load_file(out / f))
    assert_equal_states(merged, {k[len("model/"):]: v for k, v in want.items() if k.startswith("model/")}, "merged")
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in merged.values())


def test_merge_keeps_0d_int_bool_bf16_and_empty_tensors_exact(tmp_path):
    """What a consolidating tool most easily gets wrong: saved from 4 ranks with every placement."""
    run_ranks(_save_mixed, 4, str(tmp_path / "mixed"), timeout=60)
    assert main(["merge", str(tmp_path / "mixed"), str(tmp_path / "hf"), "--prefix", "tensors/", "--no-progress"]) == 0
    assert_equal_states(load_file(tmp_path / "hf" / "tensors-00001-of-00001.safetensors"), mixed_full(), "merged")


def _load_fsdp3(rank, world_size, source, hf):
    model, optim = build("fsdp3", seed=11)
    state = app_state(model, optim)
    if hf:
        stats = load_safetensors(state["model"], source)
        return full({"model": state["model"]}), stats
    stats = load(state, source, verify=False)
    return full(state), stats


def test_offline_reshard_then_each_rank_reads_only_its_own_file(fsdp4, tmp_path):
    path, want = fsdp4
    assert main(["reshard", path, str(tmp_path / "r3"), "--world-size", "3", "--no-progress"]) == 0
    assert main(["verify", str(tmp_path / "r3")]) == 0
    for rank, (got, stats) in enumerate(run_ranks(_load_fsdp3, 3, str(tmp_path / "r3"), False)):
        assert_equal_states(got, want, f"rank {rank}")
        # its own file, and rank 0's for the plain tensors (the optimizer's 0-d steps) every rank needs
        assert stats.files_opened == (1 if rank == 0 else 2) and stats.bytes_read == stats.bytes_needed, stats


def test_load_hugging_face_files_into_a_sharded_model_reads_only_each_ranks_slices(fsdp4, tmp_path):
    path, want = fsdp4
    assert main(["merge", path, str(tmp_path / "hf"), "--prefix", "model/", "--no-progress"]) == 0
    results = run_ranks(_load_fsdp3, 3, str(tmp_path / "hf"), True)
    total = sum(v.numel() * v.element_size() for k, v in want.items() if k.startswith("model/"))
    for rank, (got, stats) in enumerate(results):
        assert_equal_states(got, {k: v for k, v in want.items() if k.startswith("model/")}, f"rank {rank}")
        assert stats.bytes_read == stats.bytes_needed < total, stats
    assert sum(stats.bytes_needed for _, stats in results) == total, "each byte is read by one rank"


# -- full state dicts ---------------------------------------------------------------------------

def _full_get(rank, world_size):
    model, optim = build("hsdp2x2")
    train(model, optim, 1)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optim, options=opts)
    return msd, osd, full(app_state(model, optim))


def _full_set(rank, world_size, msd, osd):
    model, optim = build("fsdp3", seed=4)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, msd if rank == 0 else {}, options=opts)
    set_optimizer_state_dict(model, optim, osd if rank == 0 else {}, options=opts)
    return full(app_state(model, optim)), optim.param_groups[0]["lr"]


def test_full_state_dict_gathered_on_rank0_and_broadcast_into_another_layout():
    results = run_ranks(_full_get, 4, timeout=60)
    msd, osd, want = results[0]
    assert all(r[0] == {} and r[1] == {} for r in results[1:]), "only rank 0 keeps the full state"
    assert all(v.device.type == "cpu" and not hasattr(v, "placements") for v in msd.values())
    assert_equal_states({f"model/{k}": v for k, v in msd.items()},
                        {k: v for k, v in want.items() if k.startswith("model/")}, "gathered")
    assert "emb.weight" in osd["param_groups"][0]["params"] and "exp_avg" in osd["state"]["emb.weight"]
    for rank, (got, lr) in enumerate(run_ranks(_full_set, 3, msd, osd, timeout=60)):
        assert_equal_states(got, want, f"rank {rank}")
        assert lr == 1e-2
