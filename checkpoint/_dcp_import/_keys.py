"""DCP's flat keys to shardwise's flat keys, through the nested state dict that was saved.

DCP stores ``state["optim"]["param_groups"][0]["lr"]`` as ``optim.param_groups.0.lr`` with its
path in ``planner_data``, walking into a list only when it holds a tensor or a mapping; shardwise
keeps a list without tensors as one value (``_flatten.py``). `shardwise_keys` rebuilds the nested
state from the paths (tensors as ``meta`` tensors) and flattens it with shardwise's `flatten`, so
the keys are exactly those ``save`` would give.
"""

from __future__ import annotations

from typing import Any

import torch

from .._base import CheckpointError
from .._state import flatten, to_json_value

__all__ = ["shardwise_keys"]


def _nest(paths: dict[str, tuple[str | int, ...]], leaves: dict[str, Any]) -> dict:
    root: dict = {}
    made: dict[int, str] = {id(root): ""}  # containers built here -> a flat key below it (for messages)
    for key, path in paths.items():
        node = root
        for part in path[:-1]:
            if part not in node:
                node[part] = {}
                made[id(node[part])] = key
            elif id(node[part]) not in made:
                raise CheckpointError(f"DCP entry '{key}' lies inside another entry's value; the metadata's "
                                      "planner paths are inconsistent")
            node = node[part]
        if path[-1] in node:
            raise CheckpointError(f"DCP entry '{key}' has the path {list(path)[:8]} of another entry; the metadata's "
                                  "planner paths are inconsistent")
        node[path[-1]] = leaves[key]
    return _lists(root, made)


def _lists(node: Any, made: dict[int, str]) -> Any:
    """The containers built by `_nest` whose keys are list indices become lists (DCP indexes
    lists with ints and names mapping keys with strs); leaves are kept as they are."""
    if id(node) not in made:
        return node
    kinds = {type(k) for k in node}
    if kinds == {int}:
        if sorted(node) != list(range(len(node))):
            raise CheckpointError(f"the list holding DCP entry '{made[id(node)]}' has indices {sorted(node)[:8]}, "
                                  f"not 0..{len(node) - 1}")
        return [_lists(node[i], made) for i in range(len(node))]
    if int in kinds:
        raise CheckpointError(f"the container holding DCP entry '{made[id(node)]}' has both list indices and "
                              "mapping keys")
    return {k: _lists(v, made) for k, v in node.items()}


def shardwise_keys(paths: dict[str, tuple[str | int, ...]], tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   values: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], dict[str, torch.Tensor]]:
    """``(tensor keys, plain values, embedded tensors)`` for a DCP checkpoint whose entries have
    ``paths``, tensor entries ``tensors`` (dtype and shape) and non-tensor entries ``values``:
    ``{DCP key of each tensor: shardwise key}``, ``{shardwise key: JSON value}``, and
    ``{shardwise key: tensor}`` for tensors that were inside a non-tensor entry (DCP saves a
    tuple holding tensors whole, as one entry; shardwise walks into it)."""
    placeholders = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in tensors.items()}
    by_id = {id(t): k for k, t in placeholders.items()}
    tree = _nest(paths, {**values, **placeholders})
    tensor_keys: dict[str, str] = {}
    plain: dict[str, Any] = {}
    embedded: dict[str, torch.Tensor] = {}
    for leaf in flatten(tree):
        if isinstance(leaf.value, torch.Tensor) and id(leaf.value) in by_id:
            tensor_keys[by_id[id(leaf.value)]] = leaf.key
        elif isinstance(leaf.value, torch.Tensor):
            embedded[leaf.key] = leaf.value
        else:
            plain[leaf.key] = to_json_value(leaf.value, leaf.key)
    return tensor_keys, plain, embedded
