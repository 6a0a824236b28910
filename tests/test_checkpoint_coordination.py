"""Checkpoint coordination that does not grow with the world size ([Note: reusing a save's
agreement] in ``checkpoint/_save/_plan_cache.py``, [Note: gathers without padding] in
``checkpoint/_base/_comm.py``, [Note: verification shares] in ``checkpoint/_load/_verify_shares.py``).

Collectives are counted with ``benchmarks/checkpoint_scale.py``'s `CountingDist` around the real
``torch.distributed`` of the checkpoint's collectives (gloo ranks).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from benchmarks.checkpoint_scale import CountingDist
from shardwise.checkpoint import CheckpointError, load, save
from shardwise.checkpoint._base import _comm
from shardwise.checkpoint._format import Index, SavedBox, TensorEntry
from shardwise.checkpoint._geometry import Box
from shardwise.checkpoint._load._verify_shares import all_shares, box_ids, id_boxes, share_of, units_of
from shardwise.checkpoint._save._plan_cache import AgreedPlan
from shardwise.checkpoint._save._save_plan import SavePlan, build_index, meta_digest
from tests._dist import run_ranks
from tests.test_checkpoint import full

# (variant, whether the save may reuse the previous save's agreement)
SEQUENCE = [("same", False), ("same", True), ("values per rank", True), ("same", True), ("shape", False),
            ("shape", True), ("dtype", False), ("layout", False), ("layout", True), ("keys", False),
            ("mesh order", False), ("mesh order", True), ("same", False)]  # the last: evicted (4 kept)


def _state(rank: int, world: int, variant: str, step: int) -> dict:
    order = list(range(world))[::-1] if variant.startswith("mesh order") else list(range(world))
    mesh = DeviceMesh("cpu", torch.tensor(order))
    g = torch.Generator().manual_seed(step)
    rows = 10 if variant.startswith("shape") else 8
    a = torch.randn(rows, 3, generator=g, dtype=torch.float64 if variant == "dtype" else torch.float32)
    b = torch.randn(6, 4, generator=g)
    c = torch.randint(0, 99, (5,), generator=g)
    place_a = [Shard(1)] if variant.startswith("layout") else [Shard(0)]
    state = {"model": {"a": distribute_tensor(a, mesh, place_a), "b": distribute_tensor(b, mesh, [Shard(1)]),
                       "c": distribute_tensor(c, mesh, [Replicate()])},
             "step": step if variant != "values per rank" else step * 100 + rank,
             "loader": {f"dp_rank_{rank}": f"pos {step}"}, "blob": bytes([step, 1, 2])}
    if variant == "keys":
        state["model"]["d"] = distribute_tensor(torch.randn(4, 2, generator=g), mesh, [Shard(0)])
    return state


def _zeros(state):
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None if not isinstance(state, bytes) else b""


def _sequence(rank: int, world: int, root: str) -> list[dict]:
    counter = CountingDist()
    _comm.dist = counter
    out = []
    for step, (variant, _) in enumerate(SEQUENCE, start=1):
        state = _state(rank, world, variant, step)
        path = os.path.join(root, f"ckpt-{step}")
        before = dict(counter.stats.get(rank, {}))
        save(state, path)
        after = dict(counter.stats[rank])
        saved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        target = _zeros(state)
        before = dict(counter.stats[rank])
        load(target, path)
        after = dict(counter.stats[rank])
        loaded = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        want, got = full(state), full(target)
        exact = want.keys() == got.keys() and all(
            want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]) for k in want)
        plain = (target["step"], target["loader"], target["blob"]) == (state["step"], state["loader"], state["blob"])
        out.append({"variant": variant, "save": saved, "load": loaded, "exact": exact, "plain": plain})
    return out


def _collectives(c: dict) -> int:
    return c.get("calls", 0) - c.get("calls:send", 0) - c.get("calls:recv", 0)


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    return {w: run_ranks(_sequence, w, str(tmp_path_factory.mktemp(f"w{w}")), timeout=240) for w in (2, 4)}


def test_every_save_of_the_sequence_round_trips_bit_exact(sequences):
    for w, ranks in sequences.items():
        for rank, steps in enumerate(ranks):
            for i, s in enumerate(steps):
                assert s["exact"] and s["plain"], (w, rank, i, s["variant"])


def test_a_repeated_save_reuses_its_agreement_and_any_change_runs_it_again(sequences):
    for w, ranks in sequences.items():
        for rank, steps in enumerate(ranks):
            for (variant, reused), s in zip(SEQUENCE, steps):
                gathers, scatters = s["save"].get("calls:gather", 0), s["save"].get("calls:scatter", 0)
                if reused:  # only the commit's gather of the reports
                    assert (gathers, scatters) == (1, 0), (w, rank, variant, s["save"])
                else:  # the plain values' gather and scatter (each rank holds its own loader key) and the
                    # commit's gather; no owners' gather: every mesh spans the world ([Note: writers without a gather])
                    assert (gathers, scatters) == (2, 1), (w, rank, variant, s["save"])


def test_a_reused_save_takes_as_many_collectives_on_4_ranks_as_on_2(sequences):
    for i, (variant, reused) in enumerate(SEQUENCE):
        counts = {w: {_collectives(ranks[r][i]["save"]) for r in range(w)} for w, ranks in sequences.items()}
        if reused:
            assert counts[2] == counts[4] and len(counts[4]) == 1, (variant, counts)
            assert counts[4].pop() <= 12, (variant, counts)


def test_no_rank_but_0_receives_more_than_its_own_share_and_load_has_no_all_gather(sequences):
    for w, ranks in sequences.items():
        for rank, steps in enumerate(ranks):
            for (variant, reused), s in zip(SEQUENCE, steps):
                assert s["load"].get("calls:all_gather", 0) == 0 and s["save"].get("calls:all_gather", 0) == 0
                if rank and reused:
                    assert s["save"]["recv"] < 1024, (w, rank, variant, s["save"])


def _gather_long(rank: int, world: int) -> tuple[float, float]:
    counter = CountingDist()
    _comm.dist = counter
    long = "x" * 20000
    got = _comm.gather_json(long if rank == world - 1 else rank, dst=0)
    if rank == 0:
        assert got == [0, 1, 2, long]
    recv_gather = counter.stats[rank]["recv"]
    mine = _comm.scatter_json([long if r == world - 1 else r for r in range(world)] if rank == 0 else None)
    assert mine == (long if rank == world - 1 else rank)
    return recv_gather, counter.stats[rank]["recv"] - recv_gather


def test_gathers_and_scatters_move_each_rank_s_bytes_not_the_world_times_the_longest():
    out = run_ranks(_gather_long, 4)
    assert 20000 <= out[0][0] < 20000 + 200, out  # padded: 4 x 20002
    assert all(scatter < 100 for _, scatter in out[:3]), out  # padded: 20002 each
    assert 20000 <= out[3][1] < 20100, out


def _index(boxes_per_tensor: int, chunks: int, tensors: int) -> Index:
    rows = boxes_per_tensor * chunks * 2
    entries = {}
    for t in range(tensors):
        per = rows // boxes_per_tensor
        entries[f"t{t}"] = TensorEntry(torch.float32, (rows, 3), tuple(
            SavedBox(Box((i * per, 0), (per, 3)), f"rank-{i:05d}.safetensors", f"t{t}@{i}", 0,
                     2 if chunks > 1 else None, tuple(range(chunks)) if chunks > 1 else None)
            for i in range(boxes_per_tensor)))
    return Index(entries)


@pytest.mark.parametrize("seed", range(6))
def test_rank_0_s_shares_for_the_world_are_each_rank_s_own_share(seed):
    rnd = random.Random(seed)
    world, index = rnd.choice([1, 3, 5]), _index(rnd.choice([1, 2, 4]), rnd.choice([1, 3]), 3)
    ids, boxes = box_ids(index), id_boxes(index)
    needs = []
    for _ in range(world):  # random row ranges of random boxes, some ranks reading nothing
        flat = []
        for (k, b), bid in zip(boxes, range(len(boxes))):
            if rnd.random() < 0.5:
                lo = rnd.randrange(b.box.sizes[0])
                flat += [bid, lo, rnd.randrange(lo + 1, b.box.sizes[0] + 1), 12]
        needs.append(flat)
    keys = sorted(index.tensors)
    shares = all_shares(index, keys, ids, needs, world)
    seen = []
    for r in range(world):
        got = {(u.box_id, u.chunk, u.lo, u.hi) for u in units_of(index, boxes, shares[r])}
        assert got == {(u.box_id, u.chunk, u.lo, u.hi) for u in share_of(index, keys, ids, needs, r, world)}
        seen += got
    assert len(seen) == len(set(seen)) == sum(
        len(b.chunk_crc32 or (0,)) for t in index.tensors.values() for b in t.boxes)


def test_a_reused_plan_s_checksums_must_fit_its_boxes():
    plan = SavePlan(meta={"t": {"dtype": "float32", "shape": [4], "layout": None}})
    plan.agreed = AgreedPlan(7, frozenset(), {"v": [], "b": []}, skeleton=[[("t", "t@0", Box((0,), (4,)))]])
    plan.reused = True
    report = {"file": "rank-00000.safetensors", "bytes": 16, "crc": "0000000100000002", "chunks": [], "boxes": [],
              "values": {}, "blobs": {}, "meta": meta_digest(plan.meta)[:16]}
    with pytest.raises(CheckpointError, match="do not fit the boxes of its reused plan"):
        build_index(plan, [report], 1, "tok")
    report["crc"] = "00000001"
    index = build_index(plan, [report], 1, "tok")
    assert [b.crc32 for b in index.tensors["t"].boxes] == [1]


def test_a_kept_agreement_without_rank_0_s_skeleton_is_not_reused(tmp_path):
    from shardwise.checkpoint._save import _plan_cache

    _plan_cache._PLANS.clear()  # only this test's agreement (other tests of this process kept theirs)
    state = {"w": torch.arange(6.0), "step": 1}
    save(state, tmp_path / "a")
    kept = [p for plans in _plan_cache._PLANS.values() for p in plans.values()]
    assert kept and all(p.skeleton is not None for p in kept)
    for p in kept:  # as after a save whose index was never built (it failed before)
        p.skeleton = None
    state["w"] += 1
    save(state, tmp_path / "b")
    target = {"w": torch.zeros(6), "step": 0}
    load(target, tmp_path / "b")
    assert torch.equal(target["w"], state["w"]) and target["step"] == 1


@pytest.mark.parametrize("seed", range(4))
def test_packed_reads_and_shares_unpack_to_the_same_lists(seed):
    from shardwise.checkpoint._load._verify_shares import pack_ints, unpack_ints

    rnd = random.Random(seed)
    width = rnd.choice([3, 4])
    values = [rnd.randrange(-5, 10**6) for _ in range(width * rnd.randrange(0, 50))]
    assert unpack_ints(pack_ints(values, width), width) == values
    regular = [v for t in range(1000) for v in (t * 4096 + 7, 0, 2, 16)]  # rank 7's reads of 1,000 tensors
    assert len(pack_ints(regular, 4)) < 200 < len(json.dumps(regular)) // 50
    with pytest.raises(ValueError, match="records of 4 integers"):
        unpack_ints(pack_ints([1, 2, 3], 3), 4)
