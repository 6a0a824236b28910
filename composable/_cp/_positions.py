"""`feed_positions`: every call of the chosen modules gets this rank's ``position_ids``.

A context-parallel rank holds the zigzag chunks of each sequence, so its rotary embeddings
must be read at the chunks' global positions (`zigzag_positions`), not at ``0 .. T/cp - 1``.
A training loop that calls the model itself passes them (``model(tokens, positions)``). A
loop that does not call the model directly cannot: a pipeline schedule calls each stage with
the microbatch's inputs alone, and a stage after the first receives only the hidden state.
The positions are the same for every microbatch and every stage of a run (one layout per
run), so they can be attached to the modules once instead of travelling with the data.

[Note: positions as a keyword added by a pre-hook]
`feed_positions` registers a forward pre-hook (``with_kwargs=True``) on each module that adds
``position_ids=<tensor>`` (or the keyword named) to calls that do not pass it, and leaves calls
that pass it alone. A hook, not a wrapped ``forward``: hooks survive ``fully_shard``'s class
swap and see the call exactly as the caller made it, and ``remove()`` takes them off. The
tensor is read at each call from the handle (``handle.position_ids``), so a run whose sequence
length changes can set new positions without re-registering.
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
    """Pass ``keyword=position_ids`` to every call of ``modules`` (one module or several) that
    does not pass that keyword itself; see [Note: positions as a keyword added by a pre-hook].

    ``position_ids``: this rank's global positions, e.g. ``zigzag_positions(T, cp_rank, cp)``
    for the example Llama (``[T / cp]``) or ``zigzag_positions(...)[None]`` for Hugging Face
    models (``[1, T / cp]``). The module's ``forward`` must accept the keyword. Returns a
    `PositionsHandle`."""
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
