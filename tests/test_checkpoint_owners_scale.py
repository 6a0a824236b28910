"""The owner agreement of a save (`_owners.assign_writers`) on 4 ranks: one writer per distinct
box, the same verdict on every rank, and what a rank other than 0 receives grows with its own
boxes, not with the world times the boxes ([Note: why rank 0 decides, not every rank])."""

from __future__ import annotations

import json

import torch.distributed as dist

from shardwise.checkpoint._geometry._boxes import Box
from shardwise.checkpoint._geometry._owners import assign_writers
from tests._dist import run_ranks

N = 200  # boxes per rank


def _count_received(log: list[int]):
    """Wrap the collectives the checkpoint code uses so that each records the bytes this rank
    receives; returns a function that undoes the wrapping."""
    rank = dist.get_rank()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    orig = {n: getattr(dist, n) for n in ("all_gather", "gather", "scatter", "broadcast", "all_reduce")}

    def all_gather(out, t, *a, **k):
        log.append(nbytes(out))
        return orig["all_gather"](out, t, *a, **k)

    def gather(t, out=None, dst=0, *a, **k):
        log.append(nbytes(out) if rank == dst and out else 0)
        return orig["gather"](t, out, dst, *a, **k)

    def scatter(t, chunks=None, src=0, *a, **k):
        log.append(0 if rank == src else nbytes([t]))
        return orig["scatter"](t, chunks, src, *a, **k)

    def broadcast(t, src, *a, **k):
        log.append(0 if rank == src else nbytes([t]))
        return orig["broadcast"](t, src, *a, **k)

    def all_reduce(t, *a, **k):
        log.append(nbytes([t]))
        return orig["all_reduce"](t, *a, **k)

    for n, f in (("all_gather", all_gather), ("gather", gather), ("scatter", scatter),
                 ("broadcast", broadcast), ("all_reduce", all_reduce)):
        setattr(dist, n, f)
    return lambda: [setattr(dist, n, f) for n, f in orig.items()]


def _agree_owners(rank, world, case):
    # Ranks r and r + 2 hold the same N one-row boxes of "t" (replication over an axis the
    # tensor's mesh would not name); "u" is held whole by every rank.
    half = rank % 2
    held = {"t": [Box((half * N + j,), (1,)) for j in range(N)], "u": [Box((0, 0), (2, 3))]}
    shapes = {"t": (2 * N,), "u": (2, 3)}
    digest = "same"
    if case == "overlap" and rank == 3:
        held["t"][5] = Box((N + 5,), (2,))
    if case == "digest" and rank == 2:
        digest = "other"
    log: list[int] = []
    undo = _count_received(log)
    try:
        mine, problem = assign_writers(["t", "u"], shapes, held, digest, rank)
    finally:
        undo()
    own = len(json.dumps([[0, *b.offsets, *b.sizes] for b in held["t"]], separators=(",", ":")))
    return sorted((k, b.offsets, b.sizes) for k, b in mine), problem, sum(log), own


def test_one_writer_per_box_and_a_rank_receives_about_its_own_boxes():
    out = run_ranks(_agree_owners, 4, "ok")
    assert all(p is None for _, p, _, _ in out), out
    written = [w for mine, _, _, _ in out for w in mine]
    assert len(written) == len(set(written)) == 2 * N + 1  # every distinct box exactly once
    assert out[0][0][-1] == ("u", (0, 0), (2, 3)) and not out[2][0] and not out[3][0]  # lowest rank writes
    for rank in (1, 2, 3):
        received, own = out[rank][2], out[rank][3]
        # an all-gather of every rank's boxes would bring about 4 x own here
        assert received <= own + 256, (rank, received, own)


def test_a_refusal_reaches_every_rank_alike():
    out = run_ranks(_agree_owners, 4, "overlap")
    assert len({p for _, p, _, _ in out}) == 1 and "overlapping" in out[0][1] and "'t'" in out[0][1], out[0][1]
    assert all(mine == [] for mine, _, _, _ in out)
    out = run_ranks(_agree_owners, 4, "digest")
    assert len({p for _, p, _, _ in out}) == 1 and "ranks [2]" in out[0][1], out[0][1]
    assert all(mine == [] for mine, _, _, _ in out)


def test_scatter_json_gives_each_rank_its_own_object_in_one_process():
    from shardwise.checkpoint._base._comm import scatter_json
    assert scatter_json([{"a": [1, 2]}]) == {"a": [1, 2]}
