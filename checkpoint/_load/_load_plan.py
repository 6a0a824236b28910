"""A load's plan (the first half of step 1 of [Note: the steps of a load] in ``_reader.py``):
for each tensor of the target, its checks against the index (in the checkpoint, same dtype and
shape, not on the meta device, saved boxes that tile it) and the reads that fill this rank's
boxes of it; each problem one line, collected for the ranks to agree on."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._state import Leaf, rank_key
from .._format import Index, TensorEntry
from .._geometry import LocalBox, covered_numel, distinct_boxes, local_boxes, plan_reads, tiling_problem
from ._reads import Read as _Read

__all__ = ["plan_load", "rank_view"]


def rank_view(index: Index, leaves: list[Leaf], rank: int, strict: bool,
              where: str) -> tuple[Index, list[Leaf], list[tuple[Leaf, torch.Tensor]], list[str]]:
    """The plain values as ``rank`` loads them ([Note: plain values per rank] in
    ``checkpoint/_save/_save_plan.py``): ``(index whose values are this rank's, the leaves to plan with
    each saved ``bytes`` value as a uint8 tensor leaf to read, (plain leaf, its tensor) pairs,
    problems)``."""
    values: dict[str, Any] = {}
    out: list[Leaf] = []
    blobs: list[tuple[Leaf, torch.Tensor]] = []
    problems: list[str] = []
    for leaf in leaves:
        if isinstance(leaf.value, torch.Tensor):
            out.append(leaf)
            continue
        own = rank_key(leaf.key, rank)
        name = own if own in index.values or own in index.blobs else leaf.key
        if name in index.blobs:
            t = torch.empty(index.tensors[name].shape, dtype=torch.uint8)
            blobs.append((leaf, t))
            out.append(Leaf(name, t, None, None))
            continue
        if name in index.values:
            values[leaf.key] = index.values[name]
        else:
            saved = sorted(int(k.rsplit("~r", 1)[1]) for k in list(index.values) + list(index.blobs)
                           if k.startswith(leaf.key + "~r") and k[len(leaf.key) + 2:].isdigit())
            if saved and strict:
                problems.append(f"value '{leaf.key}' was saved per rank (it differed between the saving ranks) by "
                                f"ranks {saved[:8]}, and not by this rank ({rank}): load it on a rank that saved "
                                "it, or with strict=False to keep the target's value")
            if saved:
                continue
        out.append(leaf)
    return dataclasses.replace(index, values=values), out, blobs, problems


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _check_tensor(key: str, t: torch.Tensor, entry: TensorEntry, where: str, problems: list[str]) -> list[LocalBox]:
    if entry.dtype != t.dtype:
        problems.append(f"tensor '{key}' is {entry.dtype} in {where} but {t.dtype} in the target; cast one of them "
                        "so they agree")
        return []
    if entry.shape != tuple(t.shape):
        problems.append(f"tensor '{key}' has shape {list(entry.shape)} in {where} but {list(t.shape)} in the "
                        "target (a different model configuration?)")
        return []
    if t.device.type == "meta":
        problems.append(f"tensor '{key}' of the target is on the meta device; materialize it before loading")
        return []
    return local_boxes(t)


def plan_load(index: Index, leaves: list[Leaf], strict: bool, where: str):
    """``(reads, problems)``: the reads that fill this rank's part of every tensor of ``leaves``
    found in ``index``, and one line per problem (``strict``: a key missing from the index is
    one). ``where`` names the checkpoint in the lines."""
    problems: list[str] = []
    reads: list[_Read] = []
    for leaf in leaves:
        t = leaf.value
        if not isinstance(t, torch.Tensor):
            if leaf.key not in index.values and strict:
                problems.append(f"value '{leaf.key}' is not in {where}" + _similar(leaf.key, index.values))
            continue
        entry = index.tensors.get(leaf.key)
        if entry is None:
            if strict:
                problems.append(f"tensor '{leaf.key}' is not in {where}" + _similar(leaf.key, index.tensors))
            continue
        lbs = _check_tensor(leaf.key, t, entry, where, problems)
        if not lbs:
            continue
        keep = distinct_boxes([b.box for b in entry.boxes])  # exact duplicates: see _tiling.py
        saved = [entry.boxes[i] for i in keep]
        saved_boxes = [b.box for b in saved]  # once per tensor, not once per local box
        problem = tiling_problem(entry.shape, saved_boxes)
        if problem is not None:
            problems.append(f"tensor '{leaf.key}' in {where}: {problem}; the index is damaged (run verify)")
            continue
        for lb in lbs:
            items = plan_reads(lb, saved_boxes)
            if covered_numel(items) != lb.box.numel:  # cannot happen after the tiling check; kept as a guard
                problems.append(f"{where} lacks part of tensor '{leaf.key}' (box at {list(lb.box.offsets)} of size "
                                f"{list(lb.box.sizes)} is not fully saved); the index is damaged")
                continue
            reads.extend(_Read(leaf.key, _local(t), saved[it.source], it) for it in items)
    if not strict and leaves and not any(
            (leaf.key in index.tensors) if isinstance(leaf.value, torch.Tensor) else (leaf.key in index.values)
            for leaf in leaves):
        problems.append(f"no key of the target is in {where} (strict=False skips missing keys, but loading nothing at "
                        f"all is almost certainly a mistake: a different model, or a prefix such as 'model/' missing; "
                        f"first target keys: {[leaf.key for leaf in leaves[:3]]}, first saved: {list(index.tensors)[:3]})")
    return reads, problems


def _similar(key: str, names) -> str:
    close = difflib.get_close_matches(key, list(names), n=3)
    return f" (similar names there: {close})" if close else ""
