"""`CommCounter`: the collectives one rank issues, and the bytes it sends under ring algorithms.

    counter = CommCounter()
    with counter:
        loss_fn(model(x)).backward()
    counter.sent_bytes, counter.by_kind()

A ``TorchDispatchMode`` that sees every c10d collective at the dispatcher: the ops behind
``dist.all_gather_single`` / ``all_gather_into_tensor`` (``c10d._allgather_base_``),
``reduce_scatter_single`` / ``reduce_scatter_tensor`` (``c10d._reduce_scatter_base_``),
``all_reduce`` (``c10d.allreduce_``), ``broadcast`` and the functional collectives DTensor
uses for tensor parallelism (``_c10d_functional.*``). DDP's reducer and FSDP2 go through the
same ops, so one counter measures every implementation the same way.

Each call is recorded as ``Collective(kind, group_size, size_bytes)`` where ``size_bytes`` is
the logical size of the collective: the all-gather *output*, the reduce-scatter *input*, the
all-reduce or broadcast tensor. ``sent`` is what one rank sends with a bandwidth-optimal ring:

    all-gather, reduce-scatter   (n - 1) / n * size
    all-reduce                   2 (n - 1) / n * size
    broadcast                    size  (upper bound: the root's share)

which is the usual "bus bytes" convention (nccl-tests): independent of the implementation,
so measured and theoretical figures compare directly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collective", "CommCounter", "ring_sent"]


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | broadcast | all_to_all
    group_size: int
    size_bytes: int

    @property
    def sent(self) -> float:
        return ring_sent(self.kind, self.group_size, self.size_bytes)


def ring_sent(kind: str, n: int, size: float) -> float:
    """Bytes one rank sends for a collective of logical ``size`` bytes over ``n`` ranks."""
    if n <= 1:
        return 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * size
    if kind == "all_reduce":
        return 2 * (n - 1) / n * size
    return float(size)


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _pg_size(pg) -> int:
    if isinstance(pg, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(pg)
    return pg.size()


def _group_by_name(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _classify(op: str, args) -> Collective | None:
    """The Collective of one dispatcher call, or None if ``op`` is not a collective."""
    if op.startswith("c10d."):
        name = op[5:].split(".")[0]
        if name == "_allgather_base_":  # (output, input, pg, ...)
            return Collective("all_gather", _pg_size(args[2]), _nbytes(args[0]))
        if name == "allgather_":  # ([[outputs]], [inputs], pg, ...)
            return Collective("all_gather", _pg_size(args[2]), _nbytes(args[0]))
        if name == "_reduce_scatter_base_":  # (output, input, pg, ...)
            return Collective("reduce_scatter", _pg_size(args[2]), _nbytes(args[1]))
        if name == "reduce_scatter_":  # ([outputs], [[inputs]], pg, ...)
            return Collective("reduce_scatter", _pg_size(args[2]), _nbytes(args[1]))
        if name == "allreduce_":  # ([tensors], pg, ...)
            return Collective("all_reduce", _pg_size(args[1]), _nbytes(args[0]))
        if name == "broadcast_":
            return Collective("broadcast", _pg_size(args[1]), _nbytes(args[0]))
        if name in ("alltoall_base_", "alltoall_"):
            return Collective("all_to_all", _pg_size(args[2]), _nbytes(args[1]))
        return None  # barrier, send/recv, ...: not counted
    if op.startswith("_c10d_functional."):
        name = op.split(".")[1]
        if name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):  # (input, n, group)
            n = int(args[1])
            return Collective("all_gather", n, _nbytes(args[0]) * n)
        if name == "reduce_scatter_tensor":  # (input, op, n, group)
            return Collective("reduce_scatter", int(args[2]), _nbytes(args[0]))
        if name in ("all_reduce", "all_reduce_"):  # (input, op, group)
            return Collective("all_reduce", _group_by_name(args[2]), _nbytes(args[0]))
        if name == "all_to_all_single":  # (input, out_splits, in_splits, group)
            return Collective("all_to_all", _group_by_name(args[3]), _nbytes(args[0]))
        if name == "broadcast":  # (input, src, group)
            return Collective("broadcast", _group_by_name(args[2]), _nbytes(args[0]))
    return None


class CommCounter(TorchDispatchMode):
    """Records the collectives issued while it is active (see the module docstring).

    Attributes: ``calls`` (list of `Collective`, in issue order). Only the calling thread is
    observed, plus threads that inherit its dispatch state (autograd's CPU backward does).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func)
        if "c10d" in op:
            c = _classify(op, args)
            if c is not None:
                self.calls.append(c)
        return func(*args, **(kwargs or {}))

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent for c in self.calls)

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """``kind -> (number of calls, bytes sent)``, counting only calls on groups of > 1 rank."""
        n: Counter = Counter()
        b: Counter = Counter()
        for c in self.calls:
            if c.group_size > 1:
                n[c.kind] += 1
                b[c.kind] += c.sent
        return {k: (n[k], b[k]) for k in sorted(n)}
