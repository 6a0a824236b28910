"""One writer per distinct saved box, agreed by rank 0, and a tiling check before writing.

[Note: one writer per box over the world]
A rank sees only the mesh of its own DTensor. For a DTensor on a slice of a larger mesh
(``mesh["dp"]`` of a (dp, tp) mesh, or a pipeline stage's sub-mesh), the ranks of the other
slices hold the same boxes, each slice with its own coordinate 0: a rule on the DTensor's mesh
alone would write every box once per slice (which a reader cannot tell from damage). So:

1. Local (``_save_plan.plan_save``, `is_local_candidate`): a rank keeps a box only when its
   coordinate is 0 on every axis of the DTensor's mesh where it is ``Replicate``; plain tensors
   are kept by rank 0 only (same value on every rank by contract). These *candidates* still hold
   one copy per slice of the world the DTensor's mesh does not name.
2. Global, by rank 0 (`assign_writers`): every rank gathers its candidates
   (``[tensor number, offsets..., sizes...]`` rows) and a digest of the state's structure to
   rank 0, which names the lowest rank holding each distinct (tensor, box) as its writer, checks
   that each tensor's boxes tile it (``_tiling.tiling_problem``), and scatters to each rank the
   positions it must drop plus the verdict (the same on every rank).

[Note: writers without a gather]
When every DTensor lives on a mesh of the whole world (the usual case: ``fully_shard``, HSDP,
FSDP x TP on all ranks) and plain tensors are rank 0's, every candidate of step 1 is its box's
only one. The save then skips the gather: one all-reduce (``_comm.agree_values``) checks that
every rank has the same state digest and only whole-world meshes, and a second sums corner
digests to confirm the tiling ([Note: tiling checked across ranks] in ``_tiling.py``). Anything
else falls back to step 2, which also words the error.

[Note: why rank 0 decides, not every rank]
An all-gather would give every rank the world's box lists (for a 70B model with AdamW on 4,096
ranks some 200 MB and millions of entries per rank per save). With gather and scatter a rank
other than 0 receives its padded drop list, bounded by its own boxes; only rank 0 holds the
world's candidates, as it holds the world's reports for the index anyway.

Differently laid out copies of one tensor are refused through the digest, overlapping boxes
through the tiling check; both before the temporary directory exists, so a save never commits a
checkpoint it could not load.
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
