"""Issue 10 item 1: a (dp, tp) mesh where only the transformer blocks are tensor-parallel.

The embedding, final norm and head are then ``fully_shard``-ed on ``mesh["dp"]`` only, i.e.
replicated over tp, an axis their own mesh does not name. Each piece of them must be written
once over the whole world, so the checkpoint loads into 1-D FSDP and into one plain process,
bit-exact. Also: a save whose ranks' pieces do not tile a tensor raises on every rank and
commits nothing, and a checkpoint written with exact duplicate boxes (as the old code did)
still loads, while overlapping boxes are refused with a message that says so.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig
from examples.parallel import block_tp_plan
from shardwise.checkpoint import CheckpointError, load, save, set_optimizer_state_dict, verify_checkpoint
from tests._dist import run_ranks
from tests.test_checkpoint import app_state, assert_equal_states, full

CFG = LlamaConfig(vocab_size=13, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)


def _model(layout: str, seed: int):
    """``"blocks_tp"``: 2 x 2 (dp, tp), TP on the blocks only, fully_shard per block + root on
    dp. ``"fsdp"``: 1-D FSDP over the world. ``"plain"``: one process."""
    model = Llama(CFG, generator=torch.Generator().manual_seed(seed))
    if layout == "blocks_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.layers:
            sw.parallelize_module(block, mesh["tp"], block_tp_plan(sw, sequence_parallel=False))
            block.attention.n_heads //= 2
            block.attention.n_kv_heads //= 2
        for block in model.layers:
            sw.fully_shard(block, mesh=mesh["dp"])
        sw.fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp":
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("dp",))
        for block in model.layers:
            sw.fully_shard(block, mesh=mesh)
        sw.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_blocks_tp(rank, world_size, path):
    model, optim = _model("blocks_tp", seed=0)
    head = model.output.weight
    assert isinstance(head, DTensor) and head.device_mesh.mesh_dim_names == ("dp",), "head is on the dp mesh only"
    tokens = torch.randint(0, CFG.vocab_size, (4, 7), generator=torch.Generator().manual_seed(1))
    dp = rank // 2
    inputs, targets = tokens[2 * dp: 2 * dp + 2, :-1], tokens[2 * dp: 2 * dp + 2, 1:]
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    optim.step()
    state = app_state(model, optim, step=1)
    save(state, path)
    return full(state)


def _load(rank, world_size, path, layout):
    model, optim = _model(layout, seed=5)
    state = app_state(model, optim)
    load(state, path)
    set_optimizer_state_dict(model, optim, state["optim"])
    return full(app_state(model, optim, step=state["trainer"]["step"]))


@pytest.fixture(scope="module")
def blocks_tp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("partial_tp") / "ckpt")
    saved = run_ranks(_save_blocks_tp, 4, path, timeout=120)
    return path, saved[0]


def test_blocks_only_tp_save_writes_each_box_once_and_verifies(blocks_tp):
    path, _ = blocks_tp
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    index = json.load(open(os.path.join(path, "index.json")))
    for key, t in index["tensors"].items():
        boxes = [(tuple(b["offsets"]), tuple(b["sizes"])) for b in t["boxes"]]
        assert len(boxes) == len(set(boxes)), f"'{key}' has a box written twice: {boxes}"


@pytest.mark.parametrize("layout,world", [("fsdp", 2), ("plain", 1)])
def test_blocks_only_tp_checkpoint_loads_bit_exact(blocks_tp, layout, world):
    path, want = blocks_tp
    for rank, got in enumerate(run_ranks(_load, world, path, layout, timeout=120)):
        assert_equal_states(got, want, f"blocks-only TP -> {layout} rank {rank}")


# -- pieces that do not tile a tensor: refused on every rank, nothing committed -------------------

def _save_inconsistent(rank, world_size, path, mode):
    import shardwise.checkpoint._save._save_plan as writer
    from shardwise.checkpoint._geometry._boxes import Box, LocalBox

    mesh = init_device_mesh("cpu", (world_size,))
    t = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    if mode == "layout" and rank == 1:  # rank 1 passes the tensor replicated, rank 0 sharded
        t = DTensor.from_local(torch.arange(12.0).reshape(6, 2), mesh, [Replicate()], run_check=False)
    if mode == "overlap" and rank == 1:  # a placement rule gone wrong: rank 1 claims rows 2..5
        real = writer.local_boxes
        writer.local_boxes = lambda v: ([LocalBox(Box((2, 0), (4, 2)), (0, 0))] if v.shape == (6, 2) else real(v))
    try:
        save({"t": t}, path)
    except CheckpointError as e:
        return str(e)
    return None


def test_save_whose_pieces_overlap_raises_everywhere_and_commits_nothing(tmp_path):
    path = str(tmp_path / "bad")
    for mode, words in (("overlap", ["overlapping", "tensor 't'", "do not tile"]),
                        ("layout", ["ranks [1]", "different from rank 0's"])):
        messages = run_ranks(_save_inconsistent, 2, path, mode, timeout=60)
        assert all(m is not None and "every rank:" in m and all(w in m for w in words) for m in messages), messages
        assert not os.path.exists(path) and os.listdir(tmp_path) == [], os.listdir(tmp_path)


# -- checkpoints written with duplicate boxes (old code) still load; overlaps are refused ---------

def _save_plain(path):
    torch.manual_seed(0)
    state = {"w": torch.randn(6, 3), "trainer": {"step": 3}}
    save(state, path)
    return state


def _edit_boxes(path, edit):
    file = os.path.join(path, "index.json")
    index = json.load(open(file))
    edit(index["tensors"]["w"]["boxes"])
    index.pop("index_sha256", None)  # an index as older shardwise wrote it (no own checksum)
    json.dump(index, open(file, "w"))


def test_exact_duplicate_boxes_still_load(tmp_path):
    path = str(tmp_path / "dup")
    state = _save_plain(path)
    _edit_boxes(path, lambda boxes: boxes.append(dict(boxes[0])))
    target = {"w": torch.zeros(6, 3), "trainer": {"step": 0}}
    load(target, path)
    assert torch.equal(target["w"], state["w"]) and target["trainer"]["step"] == 3
    assert verify_checkpoint(path).ok


def test_overlapping_boxes_are_refused_as_overlapping(tmp_path):
    path = str(tmp_path / "overlap")
    _save_plain(path)

    def overlap(boxes):
        b = dict(boxes[0])
        boxes[0]["sizes"] = [4, 3]
        b["offsets"], b["sizes"] = [2, 0], [4, 3]  # rows 2..3 twice, sizes still add up to 8 rows > 6
        boxes.append(b)

    _edit_boxes(path, overlap)
    target = {"w": torch.zeros(6, 3), "trainer": {"step": 0}}
    with pytest.raises(CheckpointError, match="overlapping"):
        load(target, path, verify=False)
    assert torch.equal(target["w"], torch.zeros(6, 3))
    assert any("overlapping" in p for p in verify_checkpoint(path).problems)


def test_the_written_boxes_are_checked_again_before_the_commit(tmp_path, monkeypatch):
    """Second line of defence: should the owner agreement let overlapping pieces through, rank 0
    still refuses to commit (checked on the boxes the ranks report having written)."""
    import shardwise.checkpoint._save._save_plan as writer
    from shardwise.checkpoint._geometry._boxes import Box, LocalBox

    monkeypatch.setattr(writer, "assign_writers", lambda keys, shapes, held, digest, rank: (
        {(k, b) for k, boxes in held.items() for b in boxes}, None))
    monkeypatch.setattr(writer, "local_boxes", lambda v: [LocalBox(Box((0,), (3,)), (0,)),
                                                          LocalBox(Box((2,), (2,)), (2,))])
    with pytest.raises(CheckpointError, match="overlapping"):
        save({"t": torch.arange(4.0)}, tmp_path / "c")
    assert os.listdir(tmp_path) == []
