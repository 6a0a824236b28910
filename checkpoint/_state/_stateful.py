"""The `Stateful` protocol: objects a checkpoint asks for their state, anywhere in the tree.

A value of a checkpoint state that has both ``state_dict()`` and ``load_state_dict(sd)`` is
*stateful* (an ``nn.Module``, an optimizer, a user's ``AppState``). It stands for the tree its
``state_dict()`` returns:

* `save` stores ``value.state_dict()`` in its place (walked into like any other subtree, so a
  stateful inside it is expanded too);
* `load` calls ``value.state_dict()`` to get the tensors to fill, fills them, and then calls
  ``value.load_state_dict(filled)`` with that same dict, innermost stateful first (so an outer
  one sees its inner objects already restored).

torch's DCP does the same for the top-level values of the state; here a stateful may sit at
any depth (``{"app": AppState(...)}``, ``{"run": {"model": model}}``). Tensors are never
stateful (they have no ``load_state_dict``).

[Note: one order of statefuls]
A stateful's ``state_dict()`` / ``load_state_dict()`` may run collectives (a sharded model, a
data loader that gathers), so every rank must call them in the same order, whatever order
each rank built its dicts in: the keys of each dict are visited sorted (as ``str``), as torch's
DCP does, for ``state_dict()`` on save and load and for ``load_state_dict()`` (innermost first,
then in that sorted order).
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
