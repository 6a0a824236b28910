"""Collectives of the checkpoint code: agreeing on errors and moving small JSON between ranks.

A rank that finds a problem in a collective checkpoint call never raises alone (its peers would
hang in the next collective): it passes the problem to `agree`, called by every rank at the same
point, and if any rank has one every rank raises the same `CheckpointError` naming the ranks and
their messages. Everything also works without ``torch.distributed`` (rank 0 of 1). Small data
travels as UTF-8 JSON in uint8 tensors, never pickles, on the CPU for gloo and on the current
accelerator for a backend without CPU support (NCCL).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ._errors import CheckpointError

__all__ = [
    "agree", "agree_values", "all_gather_json", "alone", "broadcast_json", "collective_device", "gather_json",
    "is_distributed", "rank_and_world", "scatter_json", "sum_ints", "world_group",
]

_ALONE = contextvars.ContextVar("shardwise_checkpoint_alone", default=False)


@contextlib.contextmanager
def alone(on: bool = True) -> Iterator[None]:
    """Within it (when ``on``) this process acts as rank 0 of 1 even if a process group exists:
    DCP's ``no_dist=True`` (see ``_dcp_api``). Per thread/context (a ``ContextVar``)."""
    token = _ALONE.set(on or _ALONE.get())
    try:
        yield
    finally:
        _ALONE.reset(token)


def rank_and_world() -> tuple[int, int]:
    if not _ALONE.get() and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    return not _ALONE.get() and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_group() -> Any:
    """The group every collective here runs on (the default one), or None for a process alone."""
    return dist.group.WORLD if is_distributed() else None


def collective_device() -> torch.device:
    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    t = t.cpu().contiguous()  # never empty: json.dumps writes at least one byte
    return json.loads(ctypes.string_at(t.data_ptr(), t.numel()).decode())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank, by rank."""
    if not is_distributed():
        return [json.loads(json.dumps(obj))]
    dev, world = collective_device(), dist.get_world_size()
    data = _encode(obj).to(dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=dev))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, padded)
    return [_decode(o[: int(s.item())]) for o, s in zip(out, sizes)]


def gather_json(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` on rank ``dst`` (by rank); None on the other ranks.

    [Note: gathers without padding]
    Rank ``dst`` receives each rank's bytes exactly (a gather of the sizes, then one
    point-to-point message per rank), never the world times the longest message: what the
    writer of an index receives is the sum of what the ranks send, and a rank with a long
    message (per-rank values, many boxes) does not make every other rank's part as long.
    `scatter_json` sends the same way. Neither pads, so neither needs a broadcast of the
    longest size."""
    if not is_distributed():
        return [json.loads(json.dumps(obj))]
    dev, world, rank = collective_device(), dist.get_world_size(), dist.get_rank()
    data = _encode(obj).to(dev)  # never empty (json.dumps writes at least one byte)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)] if rank == dst else None
    dist.gather(size, sizes, dst=dst)
    if rank != dst or sizes is None:
        dist.send(data, dst)
        return None
    bufs = [data if r == dst else torch.empty(int(s.item()), dtype=torch.uint8, device=dev)
            for r, s in enumerate(sizes)]
    works = [dist.irecv(bufs[r], src=r) for r in range(world) if r != dst]
    for w in works:
        if w is not None:  # None only for a rank outside the group, which no rank here is
            w.wait()
    return [_decode(b) for b in bufs]


def _words(text: str) -> list[int]:
    """Two non-negative 62-bit words of the SHA-256 of ``text``."""
    h = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(h[:8], "little") >> 2, int.from_bytes(h[8:16], "little") >> 2]


def agree_values(texts: list[str]) -> list[bool]:
    """Collective: for each position ``i``, whether every rank passed the same ``texts[i]``
    (compared by SHA-256). Every rank must pass a list of the same length. One all-reduce of
    ``4 * len(texts)`` int64 (the digests and their negations, reduced by MAX: equal
    everywhere exactly when the maximum of each word equals its minimum), whatever the world
    size."""
    if not is_distributed() or not texts:
        return [True] * len(texts)
    words = [w for t in texts for w in _words(t)]
    dev = collective_device()
    v = torch.tensor(words + [-w for w in words], dtype=torch.int64, device=dev)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    got = v.cpu().tolist()
    n = len(words)
    return [got[2 * i] == -got[n + 2 * i] and got[2 * i + 1] == -got[n + 2 * i + 1] for i in range(len(texts))]


def sum_ints(values: list[int]) -> list[int]:
    """Collective: the sum over the ranks of each position of ``values`` (the same length on every
    rank; int64). One all-reduce of ``len(values)`` int64, whatever the world size."""
    if not is_distributed() or not values:
        return list(values)
    v = torch.tensor(values, dtype=torch.int64, device=collective_device())
    dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return v.cpu().tolist()


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the other ranks' ``obj`` is ignored)."""
    if not is_distributed():
        return json.loads(json.dumps(obj))
    dev = collective_device()
    data = _encode(obj).to(dev) if dist.get_rank() == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src)
    buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=src)
    return _decode(buf)


def _message(error: BaseException | str) -> str:
    if isinstance(error, CheckpointError) or isinstance(error, str):
        return str(error)
    return f"{type(error).__name__}: {error}"


def agree(error: BaseException | str | None, what: str) -> None:
    """Collective: raise `CheckpointError` on every rank if any rank passes an error.

    ``error`` is this rank's problem (an exception, a message, or None). The raised message
    starts with ``what`` and lists each distinct problem once with the ranks that had it; on a
    rank whose own error was an exception, that exception is chained as the cause.
    """
    mine = None if error is None else _message(error)
    if is_distributed():
        dev = collective_device()
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        messages = all_gather_json(mine)
    else:
        if mine is None:
            return
        messages = [mine]
    by_message: dict[str, list[int]] = {}
    for rank, msg in enumerate(messages):
        if msg is not None:
            by_message.setdefault(msg, []).append(rank)
    world = len(messages)
    lines = [f"{what} failed:"]
    for msg, ranks in by_message.items():
        who = "" if world == 1 else ("every rank: " if len(ranks) == world else f"rank {_ranks(ranks)}: ")
        lines.append(f"  {who}{msg}")
    exc = CheckpointError("\n".join(lines))
    if isinstance(error, BaseException):
        raise exc from error
    raise exc


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) < 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def scatter_json(objs: list[Any] | None, src: int = 0) -> Any:
    """Rank ``src`` sends ``objs[r]`` to rank ``r`` (``objs`` is ignored on the other ranks).

    Each rank receives its own object, exactly its bytes (a scatter of the sizes, then one
    point-to-point message per rank; [Note: gathers without padding]): what a rank receives
    does not grow with the world size, nor with the other ranks' objects.
    """
    if not is_distributed():
        assert objs is not None, "scatter_json: the source rank passes the objects"
        return json.loads(json.dumps(objs[0]))
    dev, world, rank = collective_device(), dist.get_world_size(), dist.get_rank()
    datas = [_encode(o).to(dev) for o in objs] if rank == src and objs is not None else None
    size = torch.zeros(1, dtype=torch.int64, device=dev)
    sizes = [torch.tensor([d.numel()], dtype=torch.int64, device=dev) for d in datas] if datas else None
    dist.scatter(size, sizes, src=src)
    if datas is not None:
        works = [dist.isend(d, dst=r) for r, d in enumerate(datas) if r != src]
        for w in works:
            if w is not None:  # as in gather_json
                w.wait()
        return _decode(datas[src])
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.recv(buf, src=src)
    return _decode(buf)
