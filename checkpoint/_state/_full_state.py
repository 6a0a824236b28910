"""Full (unsharded) state: gather it on rank 0 one tensor at a time, or spread it into shards.

`gather_full` turns a state tree with DTensors into the same tree with full tensors, one
``full_tensor()`` at a time, so a rank holds at most one full tensor beyond its shards; with
``rank0_only`` the other ranks drop each at once and get ``{}``.

`scatter_full` fills a state tree's tensors in place, each rank copying its boxes
(``_boxes.local_boxes``) out of the full tensors; with ``from_rank0`` only rank 0 has them (the
others pass ``{}``) and broadcasts them one at a time. Keys, dtypes and shapes are checked first,
and a problem on rank 0 raises on every rank before any tensor is written. To load full state
from safetensors files with each rank reading only its slices, use `load_safetensors`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._geometry import local_boxes
from .._base import CheckpointError, agree, broadcast_json, collective_device, is_distributed, rank_and_world
from ._flatten import flatten

__all__ = ["gather_full", "scatter_full", "to_cpu"]


def _rebuild(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _rebuild(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, fn) for v in value)
    return value


def to_cpu(value: Any) -> Any:
    """A state tree with every tensor on the CPU (DTensors stay DTensors, their shards copied)."""
    return _rebuild(value, lambda t: t.detach().to("cpu"))


def gather_full(state: dict, *, rank0_only: bool = True, cpu: bool = True) -> dict:
    """``state`` with every DTensor replaced by its full tensor; collective.

    ``cpu`` moves the full tensors to CPU memory; ``rank0_only`` returns ``{}`` on the other
    ranks. Plain tensors are copied (to CPU with ``cpu``); plain values are kept. One tensor
    object reached twice (tied weights) becomes one full tensor reached twice, so a writer that
    recognises ties by storage (``save_pretrained``, safetensors) still sees the tie.
    """
    rank, _ = rank_and_world()
    keep = rank == 0 or not rank0_only
    done: dict[int, Any] = {}  # a tensor reached by two names (tied weights) is gathered once, and stays one

    def full(t: torch.Tensor):
        if id(t) not in done:
            done[id(t)] = (t, gather(t))
        return done[id(t)][1]

    def gather(t: torch.Tensor):
        with torch.no_grad():
            if isinstance(t, DTensor):
                f = t.full_tensor()
                return (f.cpu() if cpu else f) if keep else None
            if not keep:
                return None
            return t.detach().to("cpu", copy=True) if cpu else t.detach()

    out = _rebuild(state, full)
    return out if keep else {}


def _problems(state: dict, full: dict, where: str) -> list[str]:
    have = {leaf.key: leaf.value for leaf in flatten(full)}
    problems = []
    for leaf in flatten(state):
        t = leaf.value
        if not isinstance(t, torch.Tensor):
            continue
        f = have.get(leaf.key)
        if not isinstance(f, torch.Tensor):
            problems.append(f"tensor '{leaf.key}' is missing from {where}")
        elif f.dtype != t.dtype or tuple(f.shape) != tuple(t.shape):
            problems.append(f"tensor '{leaf.key}' is {f.dtype} {list(f.shape)} in {where} but {t.dtype} "
                            f"{list(t.shape)} in the target")
    return problems


def _copy_boxes(t: torch.Tensor, f: torch.Tensor) -> None:
    local = t.to_local() if isinstance(t, DTensor) else t
    for lb in local_boxes(t):
        local[lb.local_region().slices()].copy_(f[lb.box.slices()])


_RAISED_AS_IS = {"KeyError": KeyError, "ValueError": ValueError, "TypeError": TypeError}


def scatter_full(state: dict, full: dict, *, from_rank0: bool = False, src: int = 0,
                 where: str = "the full state dict",
                 check: Callable[[], BaseException | None] | None = None) -> None:
    """Fill the tensors of ``state`` in place from the full tensors of ``full``; collective.

    With ``from_rank0`` only rank ``src``'s ``full`` is read (other ranks may pass ``{}``), and
    each tensor is broadcast from it in turn: a rank holds its shards and one full tensor at a
    time. Raises `CheckpointError` on every rank, before writing anything, if a tensor is
    missing or has another dtype or shape.

    ``check`` (with ``from_rank0``): called on rank ``src`` before anything moves; a
    ``KeyError`` / ``ValueError`` / ``TypeError`` it returns is raised on every rank with its
    own type and message (any other: as `CheckpointError`), at no collective of its own.
    """
    rank, _ = rank_and_world()
    if check is not None and not from_rank0:
        raise ValueError("scatter_full: check= needs from_rank0=True (one rank reads, so one rank checks)")
    reader = not from_rank0 or rank == src
    problems: list[str] | None = None
    first: list[str] | None = None  # [exception type, message] from check
    error: BaseException | str | None = None
    try:
        if reader and check is not None and (exc := check()) is not None:
            first = [type(exc).__name__, str(exc.args[0]) if exc.args else str(exc)]
        elif reader:
            problems = _problems(state, full, where)
    except Exception as e:
        error = e
    if from_rank0:
        first, problems = broadcast_json([first, problems] if rank == src else None, src=src)
    if first is not None:
        kind = _RAISED_AS_IS.get(first[0])
        if kind is None:
            raise CheckpointError(f"loading {where} failed: {first[1]}")
        raise kind(first[1])
    if problems and error is None:
        error = "\n    ".join(problems[:20]) + "\n  The target was not modified."
    agree(error, f"loading {where}")
    have = {leaf.key: leaf.value for leaf in flatten(full)} if reader else {}
    with torch.no_grad():
        for leaf in flatten(state):
            t = leaf.value
            if not isinstance(t, torch.Tensor):
                continue
            if not from_rank0 or not is_distributed():
                _copy_boxes(t, have[leaf.key])
                continue
            dev = collective_device()
            if rank == src:
                buf = have[leaf.key].to(dev).contiguous()
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device=dev)
            dist.broadcast(buf, src=src)
            _copy_boxes(t, buf)

