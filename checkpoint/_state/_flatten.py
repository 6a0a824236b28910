"""Nested state <-> flat keys.

A checkpoint ``state`` is a tree of dicts and lists whose leaves are tensors (plain or DTensors)
and plain values. Each leaf is named by its path, parts joined with ``/`` as in a JSON pointer
(RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``): ``{"model": {"emb.weight": t}}`` gives
``model/emb.weight``. An empty dict has no leaves.

* A dict is always walked into; a list (or, read-only, a tuple) only when it holds a tensor.
* Any other value is one *plain value* leaf stored as JSON (``None``, bool, int, float including
  ``NaN``/``Infinity``, str, and lists/tuples/dicts of those with str keys); tuples come back as
  lists, or as tuples where the target holds a tuple.
* ``bytes`` values are stored raw in a data file ([Note: plain values per rank] in
  ``checkpoint/_save/_save_plan.py``).
* Dict keys must be ``str`` or ``int`` (written in decimal, so ``0`` and ``"0"`` in one dict
  collide and are refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._base import CheckpointError

__all__ = ["Leaf", "flatten", "join_key", "rank_key", "set_values", "to_json_value"]


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def join_key(path: tuple[Any, ...]) -> str:
    return "/".join(_escape(p) for p in path)


def rank_key(key: str, rank: int) -> str:
    """The name under which ``rank``'s own plain value of the flat key ``key`` is saved (one that
    differed between ranks): ``key~r<rank>``, never a flat key (in those every ``~`` is followed by
    ``0`` or ``1``)."""
    return f"{key}~r{rank}"


class Leaf:
    """One leaf of a state tree: its flat ``key``, ``value``, and where it sits (``parent[slot]``)."""

    __slots__ = ("key", "value", "parent", "slot")

    def __init__(self, key: str, value: Any, parent: Any, slot: Any) -> None:
        self.key, self.value, self.parent, self.slot = key, value, parent, slot


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _walk(container: Any, path: tuple[Any, ...]) -> Iterator[Leaf]:
    items = container.items() if isinstance(container, dict) else enumerate(container)
    seen: dict[str, Any] = {}
    for k, v in items:
        if isinstance(container, dict):
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise CheckpointError(
                    f"key {k!r} of type {type(k).__name__} under '{join_key(path)}': state dict keys must be str or int"
                )
            if str(k) in seen:
                raise CheckpointError(
                    f"keys {seen[str(k)]!r} and {k!r} under '{join_key(path)}' have the same name in a checkpoint; "
                    "rename one"
                )
            seen[str(k)] = k
        if isinstance(v, torch.Tensor) or (not isinstance(v, dict) and not _has_tensor(v)):
            yield Leaf(join_key((*path, k)), v, container, k)
        else:
            yield from _walk(v, (*path, k))


def flatten(state: Any) -> list[Leaf]:
    """The leaves of ``state`` (a dict) in tree order."""
    if not isinstance(state, dict):
        raise CheckpointError(f"the checkpoint state must be a dict, got {type(state).__name__}")
    return list(_walk(state, ()))


def to_json_value(value: Any, key: str) -> Any:
    """``value`` as JSON-ready data, or a `CheckpointError` naming ``key``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, key) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(
                    f"the value at '{key}' is a dict with the {type(k).__name__} key {k!r}; plain values are stored "
                    "as JSON, whose keys are strings. Use str keys, or store the data as a tensor"
                )
            out[k] = to_json_value(v, key)
        return out
    raise CheckpointError(
        f"the value at '{key}' has type {type(value).__name__}, which is not a tensor and not JSON (None, bool, "
        "int, float, str, lists and str-keyed dicts of those). Convert it (e.g. .item(), list(...), str(...)) "
        "or store it as a tensor"
    )


def _like(saved: Any, current: Any) -> Any:
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(_like(s, c) for s, c in zip(saved, current)) if len(saved) == len(current) else tuple(saved)
    if isinstance(current, list) and isinstance(saved, list) and len(saved) == len(current):
        return [_like(s, c) for s, c in zip(saved, current)]
    if isinstance(current, float) and isinstance(saved, int) and not isinstance(saved, bool):
        return float(saved)
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: _like(v, current[k]) if k in current else v for k, v in saved.items()}
    return saved


def set_values(leaves: list[Leaf], values: dict[str, Any]) -> None:
    """Put the saved plain ``values`` into the target tree, in place of each plain leaf."""
    for leaf in leaves:
        if isinstance(leaf.value, torch.Tensor) or leaf.key not in values:
            continue
        if isinstance(leaf.parent, tuple):
            continue  # tuples are immutable; their plain values are left as they are
        leaf.parent[leaf.slot] = _like(values[leaf.key], leaf.value)
