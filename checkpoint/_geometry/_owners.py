"""One writer per distinct saved box, agreed by rank 0, and a tiling check before writing.

[Note: one writer per box over the world]
A rank can only see the mesh of its own DTensor. When a DTensor lives on a slice of a larger
mesh (``mesh["dp"]`` of a (dp, tp) mesh, as when only the transformer blocks are
tensor-parallel), the ranks of the other tp coordinates hold the same boxes on a *different*
slice, and each slice has its own coordinate 0: a rule based on the DTensor's own mesh alone
lets every slice write the same box, and the index then has every box twice (which a reader
cannot tell from damage). The same holds for pipeline stages on sub-meshes. So the writers
are agreed in two steps:

1. Local, no communication (``_save_plan.plan_save``, `is_local_candidate`): a rank keeps a box of a
   DTensor only when its coordinate is 0 on every axis of the DTensor's own mesh where the
   DTensor is ``Replicate`` (its peers on such an axis hold exactly the same boxes, and the
   coordinate-0 peer keeps them). Plain tensors are kept by rank 0 only (every rank passes the
   same value by contract). What is left, the *candidates*, still holds one copy of a box per
   slice of the world that the DTensor's mesh does not name, and nothing else.
2. Global, by rank 0 (`assign_writers`): every rank sends its candidates
   (``[tensor number, offsets..., sizes...]`` rows) and a digest of the state's structure to
   rank 0 only (a gather). Rank 0 names the writer of each distinct (tensor, box), the lowest
   rank holding exactly that box, checks once that each tensor's distinct boxes tile it
   (``_tiling.tiling_problem``), and sends each rank only its own answer (a scatter): the
   positions in its own list that it must drop, plus the verdict (the same on every rank).

[Note: writers without a gather]
Step 2 exists for DTensors on a mesh that leaves ranks out (a sub-mesh). When every rank's
DTensors live on meshes of the whole world (``fully_shard`` on the default mesh, HSDP and
FSDP x TP on a mesh of all ranks: the usual case) and plain tensors are rank 0's alone,
every candidate left by step 1 is its box's only one: the world's boxes are each rank's box of
one layout, and ``local_boxes`` gives each coordinate a distinct, non-empty box that together
tile the tensor. The save then skips the gather: one all-reduce (``_comm.agree_values``, with
the other checks of the save's planning) tells that every rank has the same state digest
(keys, dtypes, shapes and layouts) and only whole-world meshes, and a second one sums the
candidates' corner digests to confirm that they tile every tensor without rank 0 seeing them
([Note: tiling checked across ranks] in ``_tiling.py``; a placement rule gone wrong is still
caught before anything is written). Anything else falls back to step 2, which also words the
error (a digest that differs, the overlapping boxes).

[Note: why rank 0 decides, not every rank]
With an all-gather every rank would receive the world's box lists, W times its own, and build
the same dict of every box of the world and run every tiling check: for a 70B model with AdamW
(about 2,170 tensors) on 4,096 ranks, some 200 MB received and millions of entries on every
rank at every save. With the gather and scatter, a rank other than 0 receives a few integers
plus its own drop list (padded to the longest drop list, so bounded by the boxes one rank
holds, not by the world); only rank 0 holds the world's candidates, as it already holds the
world's reports when it builds the index. Step 1 makes those candidates few: on the usual
meshes all replication is over named axes and every box reaches rank 0 once.

Ranks that passed differently laid out copies of one tensor are refused through the digest
(the layout is part of it), placements whose boxes overlap through the tiling check; both
before the temporary directory is created, so a save never commits a checkpoint it could
not load.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from ._boxes import Box
from .._base import gather_json, scatter_json
from ._tiling import tiling_problem

__all__ = ["assign_writers", "is_local_candidate"]


def is_local_candidate(t: torch.Tensor, rank: int) -> bool:
    """Step 1 of [Note: one writer per box over the world]: may this rank write ``t``'s boxes?"""
    if not isinstance(t, DTensor):
        return rank == 0
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))


def _encode(keys: Sequence[str], held: dict[str, list[Box]]) -> list[list[int]]:
    number = {k: i for i, k in enumerate(keys)}
    return [[number[k], *b.offsets, *b.sizes] for k, boxes in held.items() for b in boxes]


def _decide(keys: Sequence[str], shapes: dict[str, tuple[int, ...]],
            gathered: list[dict]) -> tuple[list[list[int]], str | None]:
    """Rank 0's part: per rank, the positions of its rows it drops; and the problem or None."""
    differ = [r for r, g in enumerate(gathered) if g["meta"] != gathered[0]["meta"]]
    if differ:
        return [], (f"ranks {differ} passed tensors (keys, shapes or dtypes) different from rank 0's; every rank "
                    "must save the same state structure (e.g. build the optimizer state the same way on every rank)")
    owner: dict[tuple[int, Box], int] = {}
    drops: list[list[int]] = []
    for r, g in enumerate(gathered):
        drop = []
        for i, row in enumerate(g["boxes"]):
            k, rest = row[0], row[1:]
            n = len(rest) // 2
            if owner.setdefault((k, Box(tuple(rest[:n]), tuple(rest[n:]))), r) != r:
                drop.append(i)
        drops.append(drop)
    per_key: dict[int, list[Box]] = {}
    for k, box in owner:
        per_key.setdefault(k, []).append(box)
    for i, key in enumerate(keys):
        problem = tiling_problem(shapes[key], per_key.get(i, []))
        if problem is not None:
            return [], (f"the ranks' shards of tensor '{key}' (shape {list(shapes[key])}) do not tile it: {problem}. "
                        "Nothing was written; check the tensor's placements and mesh on every rank")
    return drops, None


def assign_writers(keys: Sequence[str], shapes: dict[str, tuple[int, ...]], held: dict[str, list[Box]],
                   digest: str, rank: int) -> tuple[set[tuple[str, Box]], str | None]:
    """Collective. ``keys``: the state's tensor keys (same order on every rank when the state's
    structure agrees, which ``digest`` checks); ``held``: this rank's candidate boxes, by key
    (after step 1 of the note).

    Returns the ``(key, box)`` pairs this rank writes and a problem (the same on every rank) or
    None. See [Note: one writer per box over the world].
    """
    rows = [(k, b) for k, boxes in held.items() for b in boxes]
    gathered = gather_json({"meta": digest, "boxes": _encode(keys, held)})
    answers = None
    if gathered is not None:  # rank 0
        drops, problem = _decide(keys, shapes, gathered)
        answers = [{"problem": problem, "drop": [] if problem else drops[r]} for r in range(len(gathered))]
    answer = scatter_json(answers)
    if answer["problem"] is not None:
        return set(), answer["problem"]
    dropped = set(answer["drop"])
    return {row for i, row in enumerate(rows) if i not in dropped}, None
