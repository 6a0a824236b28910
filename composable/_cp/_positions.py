"""`feed_positions`: every call of the chosen modules gets this rank's ``position_ids``.

A cp rank's rotary embeddings must be read at its zigzag chunks' global positions
(`zigzag_positions`). A loop that does not call the model itself (a pipeline schedule) cannot pass
them, but they are the same for every call of a run, so they are attached to the modules once.

[Note: positions as a keyword added by a pre-hook]
A forward pre-hook (``with_kwargs=True``) adds ``position_ids=<tensor>`` (or the keyword named) to
calls that do not pass it. A hook survives ``fully_shard``'s class swap and ``remove()`` takes it
off; the tensor is read from the handle at each call (``handle.position_ids`` may be reset).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PositionsHandle", "feed_positions"]


@dataclass
class PositionsHandle:
    """What `feed_positions` registered: ``position_ids`` (read at every call; assign to change
    it) and ``remove()``, which takes every hook off."""

    position_ids: torch.Tensor
    keyword: str = "position_ids"
    hooks: list[RemovableHandle] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if self.keyword in kwargs:
            return None
        return args, {**kwargs, self.keyword: self.position_ids}


def feed_positions(modules: nn.Module | Iterable[nn.Module], position_ids: torch.Tensor, *,
                   keyword: str = "position_ids") -> PositionsHandle:
    """Pass ``keyword=position_ids`` to every call of ``modules`` that does not pass it ([Note:
    positions as a keyword added by a pre-hook]); e.g. ``zigzag_positions(T, cp_rank, cp)``, or
    ``[None]`` of it for Hugging Face models. Returns a `PositionsHandle`."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"feed_positions: position_ids must be a tensor (zigzag_positions(...)), got "
                        f"{type(position_ids).__name__}")
    if not isinstance(keyword, str) or not keyword.isidentifier():
        raise ValueError(f"feed_positions: keyword={keyword!r} is not a keyword argument name")
    chosen = [modules] if isinstance(modules, nn.Module) else list(modules)
    if not chosen or not all(isinstance(m, nn.Module) for m in chosen):
        raise TypeError("feed_positions: modules must be an nn.Module or a non-empty iterable of them")
    handle = PositionsHandle(position_ids, keyword)
    for m in chosen:
        handle.hooks.append(m.register_forward_pre_hook(handle._hook, with_kwargs=True))
    return handle
