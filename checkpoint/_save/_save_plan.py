"""A save's plan and its files: which boxes this rank writes, the writing, and the index built from
the ranks' reports (steps 1, 3 and 4 of [Note: the steps of a save] in ``_writer.py``).

[Note: plain values per rank]
A plain value (JSON, or ``bytes``) is usually the same on every rank and saved once, rank 0's.
torch's DCP keeps each non-tensor value per key, so a value ranks hold under their own key
(torchtitan's ``{"dp_rank_<i>": pickle.dumps(...)}``) is saved for each. Here the ranks' value
digests go to rank 0 (one gather): a key every rank holds with the same value is *shared* (saved
once by rank 0), any other is saved *per rank* under ``rank_key(key, rank)`` (``key~r<rank>``).
A load gives each rank its own per-rank value, else the shared one; a rank that saved none finds
the key missing (strict: an error naming the ranks that saved it; ``strict=False``: the target's
value stays). ``bytes`` are stored raw (a 1-D ``uint8`` tensor in the writer's data file, listed
in the index's ``bytes``), never unpickled; JSON values stay in the index's ``values``.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._base import (CheckpointError, agree, agree_values, broadcast_json, crcs_from_hex, crcs_to_hex, gather_json,
                     rank_and_world, scatter_json, sum_ints, world_group)
from .._state import flatten, rank_key, to_json_value
from .._format import (DTYPE_CODES, FORMAT_NAME, Index, SavedBox, StreamingWriter, TensorEntry, data_file_name,
                       dtype_name, part_file_name, part_to_json)
from .._geometry import (CORNER_PRIME, Box, assign_writers, corner_digest, is_local_candidate, layout_of, local_boxes,
                         tiling_problem)
from .._storage import Storage
from ._plan_cache import AgreedPlan, fingerprint, lookup, remember

__all__ = ["INDEX_PARTS_FROM", "Piece", "SavePlan", "build_index", "keep_own_pieces", "meta_digest", "plan_save", "snapshot",
           "write_file"]


INDEX_PARTS_FROM = 64  # world size from which a save writes its index in parts ([Note: index parts] in _index.py)


@dataclass
class Piece:
    key: str  # flat key of the tensor
    box: Box  # global box
    data: Any  # the local tensor (synchronous save) or the snapshot of this box
    region: Box | None  # where the box sits in ``data``; None once ``data`` is a snapshot

    @property
    def file_key(self) -> str:
        return f"{self.key}@{','.join(map(str, self.box.offsets))}"

    def tensor(self) -> torch.Tensor:
        return self.data if self.region is None else self.data[self.region.slices()]


@dataclass
class SavePlan:
    meta: dict[str, dict] = field(default_factory=dict)  # key -> dtype, shape, layout
    pieces: list[Piece] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)  # bytes values by flat key (until `settle_plain`)
    blob_sizes: dict[str, int] = field(default_factory=dict)  # bytes values this rank writes: saved name -> size
    rank_values: dict[str, Any] = field(default_factory=dict)  # this rank's per-rank JSON values, by saved name
    path: str = ""
    agreed: AgreedPlan | None = None  # the agreement of this save ([Note: reusing a save's agreement])
    reused: bool = False  # ``agreed`` was kept from an earlier save and reused
    spans_world: bool = True  # every DTensor's mesh holds every rank ([Note: writers without a gather])
    parted: bool = False  # this rank's boxes go to its index part ([Note: index parts] in ``_format/_index.py``)


def plan_save(state: dict, rank: int) -> SavePlan:
    plan = SavePlan()
    world = rank_and_world()[1]
    with torch.no_grad():
        for leaf in flatten(state):
            v = leaf.value
            if isinstance(v, (bytes, bytearray, memoryview)):
                plan.blobs[leaf.key] = bytes(v)
                continue
            if not isinstance(v, torch.Tensor):
                plan.values[leaf.key] = to_json_value(v, leaf.key)
                continue
            if v.dtype not in DTYPE_CODES:
                raise CheckpointError(f"tensor '{leaf.key}' has dtype {v.dtype}, which safetensors cannot store")
            if v.device.type == "meta":
                raise CheckpointError(f"tensor '{leaf.key}' is on the meta device and has no data; materialize it "
                                      "(e.g. module.to_empty(device=...) and initialize) before saving")
            plan.meta[leaf.key] = {"dtype": dtype_name(v.dtype), "shape": list(v.shape), "layout": layout_of(v)}
            boxes = local_boxes(v)  # on every rank: refuses unsupported placements everywhere
            if isinstance(v, DTensor) and v.device_mesh.size() != world:
                plan.spans_world = False
            if not is_local_candidate(v, rank):
                continue  # step 1 of [Note: one writer per box over the world] in _owners.py
            local = v.to_local() if isinstance(v, DTensor) else v
            plan.pieces += [Piece(leaf.key, lb.box, local.detach(), lb.local_region()) for lb in boxes]
    return plan


def keep_own_pieces(plan: SavePlan, rank: int) -> None:
    """Collective: keep only the pieces this rank writes ([Note: one writer per box over the
    world] in ``checkpoint/_geometry/_owners.py``); raises on every rank if the ranks' boxes do not tile a tensor."""
    held: dict[str, list[Box]] = {}
    for p in plan.pieces:
        held.setdefault(p.key, []).append(p.box)
    _, world = rank_and_world()
    plan.parted = world >= INDEX_PARTS_FROM
    digest = meta_digest(plan.meta)
    fp = fingerprint(world, rank, digest, [(p.key, p.box.offsets, p.box.sizes) for p in plan.pieces],
                     list(plan.values), list(plan.blobs))
    kept = lookup(world_group(), fp)
    # rank 0 puts reused checksums on the skeleton, unless the boxes go to index parts
    usable = kept is not None and (plan.parted or rank != 0 or kept.skeleton is not None)
    text = str(kept.generation) if kept is not None and usable else f"no usable agreement kept on rank {rank}"
    keys = {"v": sorted(plan.values), "b": sorted(plan.blobs)}
    reuse, same_meta, whole, same_keys = agree_values([
        text, digest, "every mesh spans the world" if plan.spans_world else f"a sub-mesh on rank {rank}",
        json.dumps(keys)])
    if reuse and kept is not None and usable:  # every rank kept this very agreement
        plan.pieces = [p for p in plan.pieces if (p.key, p.box.offsets, p.box.sizes) in kept.writes]
        plan.agreed, plan.reused = kept, True
        _settle_plain(plan, rank, kept.common, None)
        return
    if not (same_meta and whole and _candidates_tile(plan, held)):  # [Note: writers without a gather]
        shapes = {k: tuple(m["shape"]) for k, m in plan.meta.items()}
        mine, problem = assign_writers(sorted(plan.meta), shapes, held, digest, rank)
        agree(problem, f"saving checkpoint {plan.path}")
        plan.pieces = [p for p in plan.pieces if (p.key, p.box) in mine]
    writes = frozenset((p.key, p.box.offsets, p.box.sizes) for p in plan.pieces)
    generation, common = _settle_plain(plan, rank, keys if same_keys else None, secrets.randbits(62))
    plan.agreed = AgreedPlan(generation, writes, common)
    remember(world_group(), fp, plan.agreed)


def _candidates_tile(plan: SavePlan, held: dict[str, list[Box]]) -> bool:
    """Collective (one all-reduce): whether the ranks' candidate boxes (``held``, by key) tile
    every tensor, by the sum of their corner digests ([Note: tiling checked across ranks] in
    ``_geometry/_tiling.py``)."""
    keys = sorted(plan.meta)
    mine = [r for k in keys for r in corner_digest(held.get(k, []))]
    total = [v % CORNER_PRIME for v in sum_ints(mine)]
    want: list[int] = []
    for k in keys:
        shape = tuple(plan.meta[k]["shape"])
        want += corner_digest([Box((0,) * len(shape), shape)] if math.prod(shape) else [])
    return total == want


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _value_digests(plan: SavePlan) -> dict[str, dict[str, str]]:
    return {"v": {k: _digest(json.dumps(v, sort_keys=True).encode()) for k, v in plan.values.items()},
            "b": {k: _digest(b) for k, b in plan.blobs.items()}}


def _settle_plain(plan: SavePlan, rank: int, common: dict[str, list[str]] | None,
                  draw: int | None) -> tuple[int, dict[str, list[str]]]:
    """Collective: which plain values are shared and which per rank ([Note: plain values per
    rank]); this rank keeps what it saves, and a piece for each ``bytes`` value it writes.

    With ``common`` (the keys every rank holds: of a reused agreement, or this rank's own keys
    when every rank holds the same ones): one all-reduce over their digests ([Note: reusing a
    save's agreement]); a key is shared when its digest is the same everywhere. Without: a
    gather of every rank's digests to rank 0 and a scatter of each rank's own keys and the keys
    every rank holds. ``draw`` (a new agreement): this rank's candidate for the agreement's
    generation; rank 0's is taken (sent with the scatter, else broadcast). Returns
    ``(generation, common keys)``; the generation is 0 for a reused agreement (``draw`` None)."""
    mine = _value_digests(plan)
    if common is not None:
        same = agree_values([mine[kind][k] for kind in ("v", "b") for k in common[kind]])
        equal = dict(zip([(kind, k) for kind in ("v", "b") for k in common[kind]], same))
        own = {kind: sorted(k for k in mine[kind] if not equal.get((kind, k), False)) for kind in ("v", "b")}
        generation = 0 if draw is None else int(broadcast_json(draw, src=0))
    else:
        gathered = gather_json(mine, dst=0)
        answers = None
        if gathered is not None:  # rank 0: the keys each rank saves as its own
            shared = {kind: {k for k, d in gathered[0][kind].items() if all(g[kind].get(k) == d for g in gathered)}
                      for kind in ("v", "b")}
            held_by_all = {kind: sorted(k for k in gathered[0][kind] if all(k in g[kind] for g in gathered))
                           for kind in ("v", "b")}
            answers = [{**{kind: sorted(set(g[kind]) - shared[kind]) for kind in ("v", "b")},
                        "common": held_by_all, "generation": draw} for g in gathered]
        own = scatter_json(answers)
        common, generation = own["common"], own["generation"]
    plan.rank_values = {rank_key(k, rank): plan.values.pop(k) for k in own["v"]}
    for k, data in plan.blobs.items():
        name = rank_key(k, rank) if k in own["b"] else k
        if name == k and rank != 0:
            continue  # shared: rank 0 writes it
        plan.blob_sizes[name] = len(data)
        if data:
            plan.pieces.append(Piece(name, Box((0,), (len(data),)), torch.frombuffer(bytearray(data),
                                                                                      dtype=torch.uint8), None))
    plan.blobs = {}
    return generation, common


def snapshot(plan: SavePlan) -> None:
    with torch.no_grad():
        for p in plan.pieces:
            src = p.tensor()
            p.data = torch.empty(src.shape, dtype=src.dtype, device="cpu").copy_(src)
            p.region = None


def write_file(plan: SavePlan, storage: Storage, tmp: str, rank: int) -> dict:
    """Write this rank's boxes; returns its report for the index."""
    plain = {"values": plan.rank_values, "blobs": plan.blob_sizes}
    if not plan.pieces:
        return {"file": None, "bytes": 0, "boxes": [], **plain}
    name = data_file_name(rank)
    path = storage.join(tmp, name)
    by_key = {p.file_key: p for p in plan.pieces}
    entries = [(k, p.data.dtype, p.box.sizes) for k, p in by_key.items()]
    writer = StreamingWriter(path, entries, {"format": FORMAT_NAME, "rank": str(rank)}, storage=storage)
    try:
        for k in writer.keys:
            writer.append(by_key[k].tensor())
    except BaseException:
        writer.abort()
        raise
    sums = writer.close()
    report: dict[str, Any] = {"file": name, "bytes": storage.size(path, follow=False), **plain}
    if plan.parted:  # the boxes go to this rank's index part; rank 0 gets its size and digest
        records: dict[str, list[SavedBox]] = {}
        for k, p in by_key.items():
            c = sums[k]
            records.setdefault(p.key, []).append(SavedBox(p.box, name, k, c.crc32, c.chunk_rows, c.chunk_crc32))
        data = part_to_json(records)
        storage.write_atomic(storage.join(tmp, part_file_name(rank)), data)
        report["part"] = [len(data), hashlib.sha256(data).hexdigest()]
        return report
    if plan.reused:  # rank 0 holds the boxes' geometry: only the checksums travel
        tensors = [(k, p) for k, p in by_key.items() if p.key in plan.meta]
        report["crc"] = crcs_to_hex(sums[k].crc32 for k, _ in tensors)
        report["chunks"] = [[i, sums[k].chunk_rows, crcs_to_hex(sums[k].chunk_crc32 or ())]
                            for i, (k, _) in enumerate(tensors) if sums[k].chunk_crc32 is not None]
        by_key = {k: p for k, p in by_key.items() if p.key not in plan.meta}  # bytes values: in full
    report["boxes"] = [{"key": p.key, "file_key": k, "offsets": list(p.box.offsets), "sizes": list(p.box.sizes),
                        "crc32": sums[k].crc32, "chunk_rows": sums[k].chunk_rows,
                        "chunk_crc32": None if sums[k].chunk_crc32 is None else crcs_to_hex(sums[k].chunk_crc32 or ())}
                       for k, p in by_key.items()]
    return report


def meta_digest(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def build_index(plan: SavePlan, reports: list[dict], world: int, token: str) -> Index:
    digest = meta_digest(plan.meta)
    differ = [r for r, rep in enumerate(reports) if rep["meta"] != digest[:16]]  # the first 64 bits travel
    if differ:
        raise CheckpointError(
            f"ranks {differ} passed tensors (keys, shapes or dtypes) different from rank 0's; every rank must save "
            "the same state structure (e.g. build the optimizer state the same way on every rank)"
        )
    boxes: dict[str, list[SavedBox]] = {k: [] for k in plan.meta}
    files: dict[str, int | None] = {}
    values, blobs = dict(plan.values), {}
    for rep in reports:
        values.update(rep.get("values", {}))
        blobs.update(rep.get("blobs", {}))
    meta = dict(plan.meta, **{k: {"dtype": "uint8", "shape": [n], "layout": None} for k, n in blobs.items()})
    boxes.update({k: [] for k in blobs})
    skeleton: list[list[tuple[str, str, Box]]] = []
    parts: dict[str, tuple[int, str]] = {}
    compact = plan.reused and not plan.parted
    for r, rep in enumerate(reports):
        skeleton.append([])
        if compact:
            _put_checksums(plan, r, rep, boxes)
        if rep["file"] is None:
            continue
        files[rep["file"]] = rep["bytes"]
        if plan.parted:
            parts[part_file_name(r)] = _part_record(r, rep)
            continue
        for b in rep["boxes"]:
            rows, hex_crcs = b["chunk_rows"], b["chunk_crc32"]
            chunks = None if hex_crcs is None else crcs_from_hex(hex_crcs, len(hex_crcs) // 8)
            box = Box(tuple(b["offsets"]), tuple(b["sizes"]))
            boxes[b["key"]].append(SavedBox(box, rep["file"], b["file_key"], b["crc32"], rows, chunks))
            if b["key"] in plan.meta:
                skeleton[-1].append((b["key"], b["file_key"], box))
    tensors = {}
    for k, m in meta.items():
        dtype = getattr(torch, m["dtype"])
        tensors[k] = TensorEntry(dtype, tuple(m["shape"]), tuple(boxes[k]), m["layout"])
        if plan.parted or (compact and k in plan.meta):
            continue  # boxes in parts, or the skeleton's: checked when the writers were agreed
        problem = tiling_problem(tensors[k].shape, [b.box for b in boxes[k]])
        if problem is not None:  # the written boxes themselves, checked once more before the commit
            raise CheckpointError(f"the boxes written for tensor '{k}' do not tile it: {problem}; nothing was committed")
    if plan.agreed is not None and not compact and not plan.parted:  # rank 0 keeps the geometry for the next saves
        plan.agreed.skeleton = skeleton
    return Index(tensors, values, files, world, time.time_ns(), save_id=token, blobs=frozenset(blobs), parts=parts)


def _part_record(rank: int, rep: dict) -> tuple[int, str]:
    """Rank 0: ``(bytes, sha256)`` of rank ``rank``'s index part, from its report."""
    part = rep.get("part")
    if not (isinstance(part, list) and len(part) == 2 and isinstance(part[0], int) and isinstance(part[1], str)):
        raise CheckpointError(f"rank {rank} reported no index part for its data file {rep['file']}; nothing was "
                              "committed")
    return part[0], part[1]


def _put_checksums(plan: SavePlan, rank: int, rep: dict, boxes: dict[str, list[SavedBox]]) -> None:
    """Rank 0, a reused agreement: rank ``rank``'s checksums (its compact report ``rep``) on the
    boxes of the skeleton ([Note: reusing a save's agreement])."""
    assert plan.agreed is not None and plan.agreed.skeleton is not None
    skel = plan.agreed.skeleton[rank]
    if rep["file"] is None:
        if skel:
            raise CheckpointError(f"rank {rank} wrote no data file but its reused plan has {len(skel)} boxes; "
                                  "nothing was committed")
        return
    try:
        crcs = crcs_from_hex(rep["crc"], len(skel))
        chunks = {i: (rows, crcs_from_hex(hex_crcs, len(hex_crcs) // 8)) for i, rows, hex_crcs in rep["chunks"]}
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"rank {rank}'s checksums do not fit the boxes of its reused plan ({len(skel)} boxes): "
                              f"{e}; nothing was committed") from None
    for i, ((key, file_key, box), crc) in enumerate(zip(skel, crcs)):
        rows, chunk_crcs = chunks.get(i, (None, None))
        boxes[key].append(SavedBox(box, rep["file"], file_key, crc, rows, chunk_crcs))
