"""Agreeing on a local outcome before the first collective that depends on it.

[Note: agreeing before the first collective]
A rank whose local work in `pipeline_split` raised, or whose model differs, would leave the others
waiting in the first collective until the timeout. So every rank first puts its outcome (an
error, or a fingerprint of the model) into one all-gather, and all raise together: the error as
is when every rank raised the same, else one line naming the failed ranks and the first error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

__all__ = ["Outcome", "agree", "fingerprint"]

_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


@dataclass(frozen=True)
class Outcome:
    """One rank's local result: ``error`` (``"Kind: message"``) or None, and the structure of
    its model (``blocks``, ``digest`` of its parameters' names, shapes and dtypes)."""

    error: str | None
    kind: str | None
    blocks: int | None
    digest: str | None


def fingerprint(model: nn.Module, blocks: Sequence[nn.Module] | None) -> tuple[int | None, str]:
    """``(number of blocks, digest)`` of ``model``'s parameters (names, shapes, dtypes)."""
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return (None if blocks is None else len(blocks)), h.hexdigest()[:12]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def agree(what: str, error: BaseException | None, blocks: int | None, digest: str | None) -> None:
    """Collective over the default group (a no-op without one, or with one rank): raise the same
    error on every rank if any rank's ``error`` is set or the ranks' models differ. See
    [Note: agreeing before the first collective]."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    mine = Outcome(None if error is None else _first_line(error), None if error is None else type(error).__name__,
                   blocks, digest)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [r for r, o in enumerate(every) if o.error is not None]
    if failed:
        first = every[failed[0]]
        if len(failed) == len(every) and all((o.kind, o.error) == (first.kind, first.error) for o in every):
            if error is not None:
                raise error  # the same on every rank: as raised
        ranks = ", ".join(map(str, failed))
        text = f"{what} failed on rank{'s' if len(failed) > 1 else ''} {ranks}: {first.kind}: {first.error}"
        raise _KINDS.get(first.kind or "", RuntimeError)(text) from error
    shapes = list(dict.fromkeys((o.blocks, o.digest) for o in every))  # in order of their first rank
    if len(shapes) > 1:
        parts = []
        for b, d in shapes:
            group = [r for r, o in enumerate(every) if (o.blocks, o.digest) == (b, d)]
            parts.append(f"rank{'s' if len(group) > 1 else ''} {', '.join(map(str, group))}: {b} blocks "
                         f"(parameters {d})")
        raise ValueError(f"{what}: the ranks were given different models ({'; '.join(parts)}); build the same "
                         "model (same configuration) on every rank")
