"""The `Stateful` protocol: objects a checkpoint asks for their state, anywhere in the tree.

A value with both ``state_dict()`` and ``load_state_dict(sd)`` is *stateful* (a module, an
optimizer, a user's ``AppState``; never a tensor) and stands for the tree its ``state_dict()``
returns: `save` stores that in its place (walked into like any subtree); `load` fills the tensors
of ``value.state_dict()`` and then calls ``value.load_state_dict(filled)``, innermost first. Unlike
torch's DCP (top-level values only), a stateful may sit at any depth.

[Note: one order of statefuls]
``state_dict()`` / ``load_state_dict()`` may run collectives, so every rank calls them in the same
order whatever order it built its dicts in: each dict's keys are visited sorted (as ``str``), as
torch's DCP does, on save and load (``load_state_dict()`` innermost first, then sorted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Stateful", "expand_stateful", "is_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state_dict)``; `save` and `load`
    call them for such values anywhere in the state (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(value: Any) -> bool:
    return not isinstance(value, (torch.Tensor, dict, list, tuple, str, bytes)) and isinstance(value, Stateful)


def _expand(value: Any, on_load: list[Callable[[], Any]], depth: int) -> Any:
    if depth > 100:
        raise RecursionError("the checkpoint state nests statefuls more than 100 deep (a state_dict() returning "
                             "an object that contains itself?)")
    if is_stateful(value):
        sd = value.state_dict()
        inner = _expand(sd, on_load, depth + 1)
        on_load.append(lambda: value.load_state_dict(sd))  # after its inner statefuls' (appended above)
        return inner
    if not _has_stateful(value, depth):
        return value  # kept as is: a load writes its plain values into the caller's own containers
    if isinstance(value, dict):  # in sorted key order on every rank: see [Note: one order of statefuls]
        expanded = {k: _expand(value[k], on_load, depth + 1) for k in sorted(value, key=str)}
        out: Any = {k: expanded[k] for k in value}
        on_load.append(lambda: _write_back(value, out, value.keys()))
        return out
    if isinstance(value, list):
        out = [_expand(v, on_load, depth + 1) for v in value]
        on_load.append(lambda: _write_back(value, out, range(len(value))))
        return out
    return tuple(_expand(v, on_load, depth + 1) for v in value)


def _write_back(orig: Any, copy: Any, slots: Any) -> None:
    """A copied container's plain values, as the load left them, back into the caller's."""
    for k in list(slots):
        if not _has_stateful(orig[k], 0):
            orig[k] = copy[k]


def expand_stateful(state: Any) -> tuple[Any, list[Callable[[], Any]]]:
    """``state`` with every stateful replaced by its ``state_dict()``, and the calls a load
    makes after filling it: each ``load_state_dict``, innermost first, and putting the loaded
    plain values back into the caller's containers. Containers are copied only on the way to
    a stateful; a tree without one comes back as is."""
    on_load: list[Callable[[], Any]] = []
    return _expand(state, on_load, 0), on_load


def _has_stateful(value: Any, depth: int) -> bool:
    if depth > 100:
        return False
    if is_stateful(value):
        return True
    if isinstance(value, dict):
        return any(_has_stateful(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_stateful(v, depth + 1) for v in value)
    return False
