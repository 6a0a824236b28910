"""Indexes written in parts ([Note: index parts] in ``checkpoint/_format/_index.py``) and saves
whose writers need no gather ([Note: writers without a gather] in ``checkpoint/_geometry/_owners.py``).

The world sizes here are below ``INDEX_PARTS_FROM``, so each rank lowers it to 1 before saving.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from benchmarks.checkpoint_scale import CountingDist
from shardwise.checkpoint import CheckpointError, load, save, verify_checkpoint
from shardwise.checkpoint._base import _comm
from shardwise.checkpoint._format import INDEX_FILE, part_file_name, read_index
from shardwise.checkpoint._save import _save_plan
from tests._dist import run_ranks
from tests.test_checkpoint import assert_equal_states, full, mixed_full, mixed_state


def _save_parted(rank, world, path, parted):
    _save_plan.INDEX_PARTS_FROM = 1 if parted else 1 << 30
    counter = CountingDist()
    _comm.dist = counter
    state = mixed_state(world)
    state["per_rank"] = {f"dp_rank_{rank}": bytes([rank])}
    got = []
    for step in range(2):  # the second save reuses the first one's agreement
        state["note"] = f"step {step}"
        before = dict(counter.stats.get(rank, {}))
        save(state, path, keep_last=1)
        after = counter.stats[rank]
        got.append({k: after.get(k, 0) - before.get(k, 0) for k in after})
    return got


def _load_parted(rank, world, path):
    state = mixed_state(world, swap=True)
    state["per_rank"] = {f"dp_rank_{rank}": b""}
    load(state, path, strict=False)
    return full(state["tensors"]), state["note"], state["per_rank"]


@pytest.fixture(scope="module")
def parted(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    counts = run_ranks(_save_parted, 4, str(root / "ckpt"), True, timeout=120)
    return root / "ckpt", counts


def test_an_index_in_parts_lists_each_writer_s_part_and_loads_at_every_world_size(parted):
    path, _ = parted
    raw = json.loads((path / INDEX_FILE).read_text())
    assert raw["version"] == 2 and all(t["boxes"] == [] for t in raw["tensors"].values())
    assert sorted(raw["parts"]) == sorted(part_file_name(r) for r in range(4) if (path / part_file_name(r)).exists())
    assert part_file_name(0) in raw["parts"] and len(raw["parts"]) >= 2
    index = read_index(str(path))
    assert index.version == 2 and not index.parts
    assert sum(len(t.boxes) for t in index.tensors.values()) > len(index.tensors)
    want = mixed_full()
    for world in (1, 2, 3):
        for rank, (got, note, per_rank) in enumerate(run_ranks(_load_parted, world, str(path), timeout=90)):
            assert note == "step 1" and per_rank == {f"dp_rank_{rank}": bytes([rank])}
            assert_equal_states(got, want, f"load into {world} ranks, rank {rank}")
    report = verify_checkpoint(str(path))
    assert report.fully_checked, report.problems


def test_rotation_leaves_no_part_of_the_old_checkpoint(parted):
    path, _ = parted
    names = set(os.listdir(path.parent))
    assert names <= {"ckpt", ".shardwise-series.json"} | {n for n in names if n.startswith(".shardwise")}, names


def test_a_repeated_parted_save_sends_rank_0_under_a_kib_a_rank(parted):
    _, counts = parted
    for rank, (first, second) in enumerate(counts):
        assert first.get("calls:gather", 0) == 2 and first.get("calls:scatter", 0) == 1, first  # plain values + commit
        assert second.get("calls:gather", 0) == 1 and second.get("calls:scatter", 0) == 0, second
        if rank:  # the all-reduces' share and the report: file, sizes, the part's digest, its own values
            assert second["sent"] < 1024, second
    assert counts[0][1]["recv"] < 4 * 1024, counts[0][1]


def test_the_same_saves_inline_write_version_1(tmp_path):
    run_ranks(_save_parted, 2, str(tmp_path / "ckpt"), False, timeout=90)
    raw = json.loads((tmp_path / "ckpt" / INDEX_FILE).read_text())
    assert raw["version"] == 1 and "parts" not in raw
    assert not [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".boxes.json")]


@pytest.fixture
def copy(parted, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(parted[0], dst)
    return dst


def _load_here(path):
    state = mixed_state(1, swap=True)
    load(state, str(path), strict=False)


def test_a_damaged_part_is_refused_naming_it(copy):
    part = copy / part_file_name(1)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"index part .*rank-00001\.boxes\.json is damaged"):
        _load_here(copy)
    assert not verify_checkpoint(str(copy)).ok


def test_a_missing_or_linked_part_is_refused(copy):
    part = copy / part_file_name(0)
    saved = part.read_bytes()
    part.unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000\.boxes\.json is missing; the checkpoint is damaged"):
        _load_here(copy)
    (copy / "elsewhere.json").write_bytes(saved)
    part.symlink_to(copy / "elsewhere.json")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        _load_here(copy)


def test_a_part_swapped_with_a_consistent_index_edit_still_fails_the_index_checksum(copy):
    raw = json.loads((copy / INDEX_FILE).read_text())
    part = copy / part_file_name(1)
    body = json.loads(part.read_text())
    first = next(iter(body["tensors"].values()))
    first[0]["crc32"] = "%08x" % (int(first[0]["crc32"], 16) ^ 1)
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    part.write_bytes(data)
    raw["parts"][part_file_name(1)] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / INDEX_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="its own checksum"):
        _load_here(copy)


def test_a_part_naming_an_unknown_tensor_or_a_path_outside_is_refused(copy):
    raw = json.loads((copy / INDEX_FILE).read_text())
    raw["parts"]["../evil.json"] = raw["parts"].pop(part_file_name(1))
    raw.pop("index_sha256")
    (copy / INDEX_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        _load_here(copy)


def test_the_cli_inspects_and_verifies_a_parted_checkpoint(parted):
    path, _ = parted
    for cmd in ("inspect", "verify"):
        out = subprocess.run([sys.executable, "-m", "shardwise.checkpoint", cmd, str(path)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout


def _save_sub_mesh(rank, world, path):
    """A DTensor on a sub-mesh (half the ranks): the writers are agreed by rank 0's gather."""
    _save_plan.INDEX_PARTS_FROM = 1
    counter = CountingDist()
    _comm.dist = counter
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    t = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh["dp"], [Shard(0)])
    save({"t": t, "step": 1}, path)
    return counter.stats[rank].get("calls:gather", 0)


def test_a_sub_mesh_falls_back_to_the_owners_gather_and_writes_each_box_once(tmp_path):
    gathers = run_ranks(_save_sub_mesh, 4, str(tmp_path / "ckpt"), timeout=90)
    assert set(gathers) == {2}, gathers  # the owners' gather and the commit's (the plain values agree)
    index = read_index(str(tmp_path / "ckpt"))
    assert sorted(b.box.offsets for b in index.tensors["t"].boxes) == [(0, 0), (4, 0)]
    state = {"t": torch.zeros(8, 3), "step": 0}
    load(state, str(tmp_path / "ckpt"))
    assert torch.equal(state["t"], torch.arange(24.0).reshape(8, 3)) and state["step"] == 1
