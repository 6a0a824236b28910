"""One writer per distinct saved box, agreed over the whole world, and a tiling check before writing.

[Note: one writer per box over the world]
A rank can only see the mesh of its own DTensor. When a DTensor lives on a slice of a larger
mesh (``mesh["dp"]`` of a (dp, tp) mesh, as when only the transformer blocks are
tensor-parallel), the ranks of the other tp coordinates hold the same boxes on a *different*
slice, and each slice has its own coordinate 0: a rule based on the DTensor's own mesh alone
lets every slice write the same box, and the index then has every box twice (which a reader
cannot tell from damage). So before anything is written every rank sends the boxes it holds
(one all-gather of ``[tensor number, offsets..., sizes...]`` lists plus a digest of the state's
structure), and every rank works out the same answer from the same lists: the writer of a box
is the lowest rank holding exactly that box. Plain (non-DTensor) tensors are held by rank 0
only (every rank passes the same value by contract).

From the same lists every rank checks that each tensor's distinct boxes tile it exactly
(``_tiling.tiling_problem``): ranks that passed differently laid out copies of one tensor, or
placements whose boxes overlap, are refused on every rank before the temporary directory is
created, so a save never commits a checkpoint it could not load.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._boxes import Box
from ._comm import all_gather_json
from ._tiling import tiling_problem

__all__ = ["assign_writers"]


def _encode(keys: Sequence[str], held: dict[str, list[Box]]) -> list[list[int]]:
    number = {k: i for i, k in enumerate(keys)}
    return [[number[k], *b.offsets, *b.sizes] for k, boxes in held.items() for b in boxes]


def assign_writers(keys: Sequence[str], shapes: dict[str, tuple[int, ...]], held: dict[str, list[Box]],
                   digest: str, rank: int) -> tuple[set[tuple[str, Box]], str | None]:
    """Collective. ``keys``: the state's tensor keys (same order on every rank when the state's
    structure agrees, which ``digest`` checks); ``held``: the boxes this rank holds, by key.

    Returns the ``(key, box)`` pairs this rank writes and a problem (the same on every rank) or
    None. See [Note: one writer per box over the world].
    """
    gathered = all_gather_json({"meta": digest, "boxes": _encode(keys, held)})
    differ = [r for r, g in enumerate(gathered) if g["meta"] != gathered[0]["meta"]]
    if differ:
        return set(), (f"ranks {differ} passed tensors (keys, shapes or dtypes) different from rank 0's; every rank "
                       "must save the same state structure (e.g. build the optimizer state the same way on every rank)")
    owner: dict[tuple[int, Box], int] = {}
    for r, g in enumerate(gathered):
        for row in g["boxes"]:
            k, rest = row[0], row[1:]
            n = len(rest) // 2
            owner.setdefault((k, Box(tuple(rest[:n]), tuple(rest[n:]))), r)
    per_key: dict[int, list[Box]] = {}
    for k, box in owner:
        per_key.setdefault(k, []).append(box)
    for i, key in enumerate(keys):
        problem = tiling_problem(shapes[key], per_key.get(i, []))
        if problem is not None:
            return set(), (f"the ranks' shards of tensor '{key}' (shape {list(shapes[key])}) do not tile it: {problem}. "
                           "Nothing was written; check the tensor's placements and mesh on every rank")
    mine = {(keys[k], box) for (k, box), r in owner.items() if r == rank}
    return mine, None
