"""Split a model with a list of blocks into this rank's pipeline stages, names unchanged.

[Note: how a model is split]
The model is ``pre-modules -> layers[0..n-1] -> post-modules``; its own ``forward`` loops over
``layers`` (``model.layers``, ``model.model.layers`` or a dotted path). Pre-modules (embedding)
and post-modules (norm, head) are the children with parameters on the path to ``layers`` that run
before / after the blocks; children without parameters stay on every stage. The rank model keeps
only its stages' blocks under their original names (and the pre/post-modules on the first/last
stage; the others become parameter-less stand-ins), so its ``state_dict()`` has the unsplit
model's names. Each stage runs through a *stage shell*: a shallow copy of the path modules whose
``layers`` holds only its blocks, running the model's own ``forward``; after the first stage the
pre-modules are a ``_Feed`` returning the received activation (swapped into the first block's
input by a pre-hook); before the last the post-modules are identities and the last block's output
is sent on. ``fully_shard`` goes per stage: each block, then the shell.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.nn as nn

from .._schedules import stage_rank

__all__ = ["Blocks", "StageShell", "blocks_list", "classify", "find_layers", "split_model"]


class Blocks(nn.Module):
    """The kept blocks of a split ``layers`` list, registered under their original indices;
    iterates, indexes (by position) and slices like the list it replaces."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for i in sorted(blocks):
            self.add_module(str(i), blocks[i])

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, idx: int) -> nn.Module:
        return list(self)[idx]


class _Slot:
    """Per stage: the activation received for the microbatch now running, and the output captured."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.out: torch.Tensor | None = None


class _Feed(nn.Module):
    """Stands in for a pre-module on a later stage: returns the received activation."""

    def __init__(self, slot: _Slot, name: str) -> None:
        super().__init__()
        self._slot, self._name = slot, name

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._slot.value is None:
            raise RuntimeError(f"pipeline: '{self._name}' lives on the first stage; this stage takes its input "
                               "from the previous one (run the model through PipelineSchedule.step)")
        return self._slot.value.detach()


class _Identity(nn.Module):
    """Stands in for a post-module on an earlier stage: returns its first argument."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class _Absent(nn.Module):
    """Stands in, in the rank model, for a module held by another stage."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"pipeline: '{self._name}' is held by another pipeline stage; the rank model is split "
                           "and only runs through PipelineSchedule.step")


def find_layers(model: nn.Module, layers: str | None = None) -> tuple[list[nn.Module], list[str]]:
    """``(path modules from the root, attribute names)``: ``path[i]._modules[names[i]]`` is
    ``path[i+1]``, and the last name is the blocks list on ``path[-1]``."""
    candidates = [layers] if layers else ["layers", "model.layers", "transformer.h", "model.decoder.layers"]
    for dotted in candidates:
        parts = dotted.split(".")
        node, path = model, [model]
        ok = True
        for name in parts:
            child = node._modules.get(name) if isinstance(node, nn.Module) else None
            if child is None:
                ok = False
                break
            node = child
            path.append(node)
        if ok and isinstance(node, (nn.ModuleList, nn.Sequential, Blocks)) and len(node) > 0:
            return path[:-1], parts
        if layers:
            break
    want = f"'{layers}'" if layers else "a 'layers' list (model.layers or model.model.layers)"
    raise ValueError(f"pipeline: {type(model).__name__} has no splittable list of blocks: looked for {want} as a "
                     "non-empty nn.ModuleList; pass layers='dotted.path.to.blocks' naming the list its forward loops "
                     "over, or use pp=1")


@dataclass
class StageShell:
    """One pipeline stage held by this rank: ``module`` (the shell to call), its blocks (global
    indices), whether it is the first/last stage, and its activation slot."""

    index: int
    module: nn.Module
    block_ids: list[int]
    is_first: bool
    is_last: bool
    slot: _Slot = field(default_factory=_Slot)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(_blocks_of(self.module, self._path_names))

    _path_names: tuple = ()


def _blocks_of(module: nn.Module, names: Sequence[str]) -> nn.ModuleList | nn.Sequential | Blocks:
    node = module
    for n in names:
        child = node._modules[n]
        assert child is not None, f"the blocks path names existing modules ({n})"
        node = child
    assert isinstance(node, (nn.ModuleList, nn.Sequential, Blocks)), "the path ends at a blocks list"
    return node


def _shallow(m: nn.Module) -> nn.Module:
    c = copy.copy(m)
    for k, v in list(vars(m).items()):
        if isinstance(v, dict):  # _modules, _parameters, _buffers and every hook dict: own copies
            c.__dict__[k] = type(v)(v) if not hasattr(v, "default_factory") else copy.copy(v)
    return c


def _child(path: list[nn.Module], d: int, name: str) -> nn.Module:
    child = path[d]._modules[name]
    assert child is not None, f"classify picks only modules that exist ({name})"
    return child


def blocks_list(path: list[nn.Module], names: list[str]) -> nn.ModuleList | nn.Sequential | Blocks:
    """The blocks list at the end of ``path`` (`find_layers` checked it is one)."""
    blocks = path[-1]._modules[names[-1]]
    assert isinstance(blocks, (nn.ModuleList, nn.Sequential, Blocks)), "find_layers returns a path to a blocks list"
    return blocks


def classify(path: list[nn.Module], names: list[str],
             order: Sequence[nn.Module] | None) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(pre, post)``: lists of ``(path index, child name)`` of the parameter-holding children of
    the path modules, before / after the blocks. ``order``: modules in the order their forward
    first ran (from a sample pass); None: registration order."""
    blocks = blocks_list(path, names)
    pre: list[tuple[int, str]] = []
    post: list[tuple[int, str]] = []
    for d, node in enumerate(path):
        if any(True for _ in node._parameters.values() if _ is not None):
            bad = [n for n, p in node._parameters.items() if p is not None]
            raise ValueError(f"pipeline: {type(node).__name__} holds parameters {bad} directly (not in a submodule); "
                             "a pipeline stage can only own whole submodules: move them into a module, or use pp=1")
        seen_path = False
        for name, child in node._modules.items():
            if name == names[d]:
                seen_path = True
                continue
            if child is None or not any(True for _ in child.parameters()):
                continue
            if order is not None and child in order:
                first = order.index(child) < order.index(blocks[0]) if blocks[0] in order else not seen_path
            else:
                first = not seen_path
            (pre if first else post).append((d, name))
    pre_params = {id(p) for d, n in pre for p in _child(path, d, n).parameters()}
    post_params = {id(p) for d, n in post for p in _child(path, d, n).parameters()}
    block_params = {id(p) for p in blocks.parameters()}
    if pre_params & post_params or (pre_params | post_params) & block_params:
        raise ValueError("pipeline: a parameter is shared between modules that land on different stages (e.g. an "
                         "embedding tied to the output head); untie it (tie_word_embeddings=False) or use pp=1")
    return pre, post


def split_model(model: nn.Module, path: list[nn.Module], names: list[str], pre: list[tuple[int, str]],
                post: list[tuple[int, str]], bounds: Sequence[int],
                pp: int, pp_rank: int, placement: str = "loop") -> list[StageShell]:
    """Turn ``model`` into this rank's rank model and return its stage shells; see
    [Note: how a model is split]. Stage ``s`` (blocks ``bounds[s]..bounds[s+1]-1``) is on rank
    ``s % pp`` (or as ``placement`` says: [Note: stage placement] in ``_pipeline/_schedules/_placement.py``)."""
    num_stages = len(bounds) - 1
    blocks = list(blocks_list(path, names))
    mine = [s for s in range(num_stages) if stage_rank(s, pp, placement) == pp_rank]
    originals = {(d, n): path[d]._modules[n] for d, n in [*pre, *post]}
    shells = []
    for s in mine:
        slot = _Slot()
        copies = [_shallow(m) for m in path]
        for d in range(len(copies) - 1):
            copies[d]._modules[names[d]] = copies[d + 1]
        ids = list(range(bounds[s], bounds[s + 1]))
        copies[-1]._modules[names[-1]] = Blocks({i: blocks[i] for i in ids})
        for d, n in pre:
            copies[d]._modules[n] = originals[(d, n)] if s == 0 else _Feed(slot, ".".join(names[:d] + [n]))
        for d, n in post:
            copies[d]._modules[n] = originals[(d, n)] if s == num_stages - 1 else _Identity()
        shells.append(StageShell(s, copies[0], ids, s == 0, s == num_stages - 1, slot, tuple(names)))
    # the rank model: this rank's blocks under their original names, stand-ins elsewhere
    kept = {i: blocks[i] for s in mine for i in range(bounds[s], bounds[s + 1])}
    path[-1]._modules[names[-1]] = Blocks(kept)
    for d, n in pre:
        if 0 not in mine:
            path[d]._modules[n] = _Absent(".".join(names[:d] + [n]))
    for d, n in post:
        if num_stages - 1 not in mine:
            path[d]._modules[n] = _Absent(".".join(names[:d] + [n]))
    return shells
