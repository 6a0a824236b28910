"""Cost of working out the checksum shares of a verified load at cluster scale (no files, no ranks).

    python benchmarks/verify_share_scale.py --tensors 2200 --save-ranks 64 --chunks 8 --load-ranks 128

Builds an in-memory index of ``--tensors`` tensors, each saved as ``--save-ranks`` dim-0 boxes of
``--chunks`` checksum chunks (a 70B-parameter model with AdamW state saved from 64 ranks has
about 2,200 tensors and 8 chunks per box), lets ``--load-ranks`` ranks each load an even dim-0
slab of every tensor, and times what every rank of a verified `load` computes before reading:
the box ids, the union of the loaded tensors, its own share (`_verify_shares.share_of`). Also
checks, on a few ranks, that the shares are disjoint.
"""

from __future__ import annotations

import argparse
import time

import torch

from shardwise.checkpoint._geometry._boxes import Box
from shardwise.checkpoint._load._verify_shares import box_ids, keys_to_mask, mask_to_keys, needs_of, share_of
from shardwise.checkpoint._format import Index, SavedBox, TensorEntry


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=2200)
    p.add_argument("--save-ranks", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8, help="checksum chunks per saved box")
    p.add_argument("--load-ranks", type=int, default=128)
    args = p.parse_args(argv)
    S, C, L = args.save_ranks, args.chunks, args.load_ranks
    chunk_rows, rows = 16, S * args.chunks * 16
    tensors = {}
    for t in range(args.tensors):
        boxes = tuple(SavedBox(Box((r * rows // S, 0), (rows // S, 1024)), f"rank-{r:05d}.safetensors", f"t{t}@{r}",
                               0, chunk_rows, tuple(range(C))) for r in range(S))
        tensors[f"t{t:05d}"] = TensorEntry(torch.float32, (rows, 1024), boxes)
    index = Index("/nowhere", tensors)
    first_ids = box_ids(index)
    needs = []
    for r in range(L):  # what each load rank reads: rows [lo, hi) of every tensor
        lo, hi = r * rows // L, (r + 1) * rows // L
        reads = [(b.file, b.key, Box((max(lo, b.box.offsets[0]) - b.box.offsets[0], 0),
                                     (min(hi, b.box.offsets[0] + b.box.sizes[0]) - max(lo, b.box.offsets[0]), 1024)), 4)
                 for t in tensors.values() for b in t.boxes
                 if max(lo, b.box.offsets[0]) < min(hi, b.box.offsets[0] + b.box.sizes[0])]
        needs.append(needs_of(reads, first_ids))
    start = time.perf_counter()
    ids = box_ids(index)
    keys = mask_to_keys(index, [keys_to_mask(index, list(tensors))])
    mine = share_of(index, keys, ids, needs, 0, L)
    took = time.perf_counter() - start
    seen: set = set()
    for r in sorted({0, 1, L // 2, L - 1}):
        units = {(u.box_id, u.chunk) for u in share_of(index, keys, ids, needs, r, L)}
        assert not units & seen, f"rank {r}'s share overlaps another's"
        seen |= units
    print(f"{args.tensors:,} tensors x {S} saved boxes x {C} chunks = {args.tensors * S * C:,} checksum units, "
          f"{L} load ranks: rank 0 worked out its share ({len(mine):,} units) in {took:.2f} s")


if __name__ == "__main__":
    main()
