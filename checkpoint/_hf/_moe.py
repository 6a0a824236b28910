"""Mixture-of-experts tensors under Hugging Face's per-expert file names (merge, HF folders).

[Note: expert names in a Hugging Face folder]
A shardwise MoE saves block ``P``'s experts stacked (``P.experts.w1`` / ``w3`` ``[E, hidden,
dim]``, ``w2`` ``[E, dim, hidden]``, router ``P.router.gate.weight``); transformers 5.x holds
them fused (``gate_up_proj``, gate rows first, and ``down_proj``). HF's files have one tensor
per expert and projection:

| architecture | expert ``e`` of block ``P = model.layers.N.mlp`` | router |
| --- | --- | --- |
| Mixtral | ``model.layers.N.block_sparse_moe.experts.e.{w1,w3,w2}.weight`` | ``...block_sparse_moe.gate.weight`` |
| Qwen2-MoE, Qwen3-MoE | ``P.experts.e.{gate_proj,up_proj,down_proj}.weight`` | ``P.gate.weight`` |

(``w1``/``gate_proj`` = ``w1[e]``, ``w3``/``up_proj`` = ``w3[e]``, ``w2``/``down_proj`` = ``w2[e]``;
Qwen2-MoE's ``shared_experts`` are ``shared_expert``). `expert_view` maps names and shapes to the
transformers model's (for `HFConfig.select`) and lists the `Part` s to write. Stacked experts of
an unmapped architecture raise `CheckpointError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._base import CheckpointError
from .._geometry import Box

__all__ = ["Part", "ExpertView", "expert_view", "region"]

_STYLES = {"Mixtral": ("w1", "w3", "w2"), "Qwen2Moe": ("gate_proj", "up_proj", "down_proj"),
           "Qwen3Moe": ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True)
class Part:
    """One tensor of the output: ``name`` in the file, the ``box`` of the state's tensor
    ``source`` it holds, written with ``shape`` (the box's sizes without a leading 1)."""

    name: str
    source: str
    box: Box
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertView:
    """``shapes``: name -> shape as the transformers model holds it; ``parts[name]``: what to
    write for it; ``source[name]``: the state's tensor a renamed (not split) name reads."""

    shapes: dict[str, tuple[int, ...]]
    parts: dict[str, list[Part]]
    source: dict[str, str]


def _whole(name: str, source: str, shape: tuple[int, ...]) -> Part:
    return Part(name, source, Box((0,) * len(shape), tuple(shape)), tuple(shape))


def _expert(name: str, source: str, e: int, row: int, rows: int, shape: tuple[int, ...]) -> Part:
    return Part(name, source, Box((e, row) + (0,) * (len(shape) - 2), (1, rows) + tuple(shape[2:])),
                (rows,) + tuple(shape[2:]))


def _style(architecture: str) -> tuple[str, tuple[str, str, str]] | None:
    for stem, names in _STYLES.items():
        if architecture.startswith(stem):
            return stem, names
    return None


def expert_view(architecture: str, shapes: dict[str, tuple[int, ...]]) -> ExpertView:
    """The `ExpertView` of a state with tensors ``shapes`` written for ``architecture`` (a
    transformers class name); see [Note: expert names in a Hugging Face folder]."""
    style = _style(architecture)
    out_shapes: dict[str, tuple[int, ...]] = {}
    parts: dict[str, list[Part]] = {}
    source: dict[str, str] = {}
    stacked = sorted(k[:-len(".experts.w1")] for k in shapes if k.endswith(".experts.w1"))
    fused = sorted(k[:-len(".experts.gate_up_proj")] for k in shapes if k.endswith(".experts.gate_up_proj"))
    if stacked and style is None:
        raise CheckpointError(f"the tensors hold stacked experts ({stacked[0]}.experts.w1 ...), and {architecture} "
                              "has no per-expert name mapping here (Mixtral, Qwen2-MoE and Qwen3-MoE have one); "
                              "write the folder without a config, or for one of those architectures")
    taken: set[str] = set()
    stem, names = style if style is not None else ("", ("", "", ""))
    for block in stacked if style else []:
        keys = [f"{block}.experts.{w}" for w in ("w1", "w3", "w2")] + [f"{block}.router.gate.weight"]
        missing = [k for k in keys if k not in shapes]
        if missing:
            raise CheckpointError(f"MoE block {block}: {missing} missing next to {block}.experts.w1")
        w1, w3, w2, gate = keys
        num, hidden, dim = shapes[w1]
        out = _out_prefix(block, stem)
        up: list[Part] = []
        down: list[Part] = []
        for e in range(num):
            up += [_expert(f"{out}.experts.{e}.{names[0]}.weight", w1, e, 0, hidden, shapes[w1]),
                   _expert(f"{out}.experts.{e}.{names[1]}.weight", w3, e, 0, hidden, shapes[w3])]
            down.append(_expert(f"{out}.experts.{e}.{names[2]}.weight", w2, e, 0, dim, shapes[w2]))
        out_shapes[f"{block}.experts.gate_up_proj"] = (num, 2 * hidden, dim)
        parts[f"{block}.experts.gate_up_proj"] = up
        out_shapes[f"{block}.experts.down_proj"] = tuple(shapes[w2])
        parts[f"{block}.experts.down_proj"] = down
        out_shapes[f"{block}.gate.weight"] = tuple(shapes[gate])
        parts[f"{block}.gate.weight"] = [_whole(f"{out}.gate.weight", gate, shapes[gate])]
        source[f"{block}.gate.weight"] = gate
        taken.update(keys)
        for k in [k for k in shapes if k.startswith(f"{block}.shared_experts.")]:
            model_name = f"{block}.shared_expert." + k[len(f"{block}.shared_experts."):]
            out_shapes[model_name] = tuple(shapes[k])
            parts[model_name] = [_whole(model_name, k, shapes[k])]
            source[model_name] = k
            taken.add(k)
    for block in fused if style else []:
        gu, dn = f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"
        if dn not in shapes:
            raise CheckpointError(f"MoE block {block}: {dn} missing next to {gu}")
        num, two_hidden, dim = shapes[gu]
        out = _out_prefix(block, stem)
        hidden = two_hidden // 2
        parts[gu] = [p for e in range(num) for p in (
            _expert(f"{out}.experts.{e}.{names[0]}.weight", gu, e, 0, hidden, shapes[gu]),
            _expert(f"{out}.experts.{e}.{names[1]}.weight", gu, e, hidden, hidden, shapes[gu]))]
        parts[dn] = [_expert(f"{out}.experts.{e}.{names[2]}.weight", dn, e, 0, dim, shapes[dn]) for e in range(num)]
        out_shapes[gu], out_shapes[dn] = tuple(shapes[gu]), tuple(shapes[dn])
        if f"{block}.gate.weight" in shapes:
            g = f"{block}.gate.weight"
            parts[g] = [_whole(f"{out}.gate.weight", g, shapes[g])]
            out_shapes[g] = tuple(shapes[g])
            taken.add(g)
        taken.update((gu, dn))
    for k, shape in shapes.items():
        if k not in taken:
            out_shapes[k] = tuple(shape)
            parts[k] = [_whole(k, k, shape)]
            source[k] = k
    return ExpertView(out_shapes, parts, source)


def _out_prefix(block: str, stem: str) -> str:
    """Mixtral's files name the block ``block_sparse_moe`` where the model names it ``mlp``."""
    if stem != "Mixtral":
        return block
    head, _, leaf = block.rpartition(".")
    if leaf != "mlp":
        raise CheckpointError(f"MoE block {block}: Mixtral's blocks are 'model.layers.N.mlp' (written as "
                              "'block_sparse_moe'); rename the module or write without a config")
    return f"{head}.block_sparse_moe"


def region(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """The box ``offsets`` / ``sizes`` of ``full`` (a view)."""
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        full = full.narrow(d, o, n)
    return full
