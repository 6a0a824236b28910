"""Complete Hugging Face model folders: what ``save_pretrained`` writes, checked against the config.

A folder that ``from_pretrained(folder)`` reads correctly holds ``config.json`` (the
architecture and its sizes), the weights as ``model.safetensors`` or as
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, and optionally
``generation_config.json``. Without ``config.json`` transformers builds the class's *default*
configuration (a 124M GPT-2, a 7B Llama) and loads the tensors into it: shape errors, or
random weights where names do not match.

[Note: checking a folder before writing it]
`HFConfig.select` builds the config's architecture (``config["architectures"][0]``, a
transformers class) on the meta device and compares its state dict with the tensors to be
written: every name the model expects must be there with the same shape (any dtype; transformers
casts), no other name may be there, and of a group of names the model ties (one ``Parameter``
reached by two names, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) only the
first is written, as ``save_pretrained`` does, after checking that the others hold the same
values (a head trained untied under a config that ties it would otherwise be silently
replaced by the embedding). Anything else raises `CheckpointError` listing the differences,
before a file is written. This needs ``transformers`` (``pip install transformers``) where
the folder is written.

Used by ``merge_checkpoint(..., config=...)`` (``_offline.py``, from a checkpoint on disk) and
by `save_hf_folder` (from a live, possibly sharded, model; collective).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._comm import agree, broadcast_json, collective_device, is_distributed, rank_and_world
from ._commit import check_target, commit, remove_temp, temp_dir_for
from ._errors import CheckpointError
from ._format import StreamingWriter
from ._hf import HF_INDEX_FILE, TENSORS_INDEX_FILE
from ._hf_moe import expert_view, region
from ._storage import PosixStorage


def write_json(path: str, text: str) -> None:
    """Write ``text`` to the local file ``path`` atomically (``Storage.write_atomic``)."""
    PosixStorage().write_atomic(path, text.encode())

__all__ = ["HFConfig", "read_config", "model_prefix", "shard_names", "index_file_name", "group_shards",
           "save_hf_folder"]

CONFIG_FILE = "config.json"
_EXTRA_FILES = ("generation_config.json",)


@dataclass(frozen=True)
class HFConfig:
    """A transformers config to write next to the weights, and what its model expects.

    ``text``: the ``config.json`` to write; ``extra``: other files to copy (name -> bytes);
    ``expected``: state dict name -> shape of the architecture; ``ties``: groups of names that
    are one parameter in it, the one ``save_pretrained`` keeps first.
    """

    architecture: str
    text: str
    expected: dict[str, tuple[int, ...]]
    ties: tuple[tuple[str, ...], ...]
    extra: dict[str, bytes] = field(default_factory=dict)

    def select(self, shapes: dict[str, tuple[int, ...]], same: Callable[[str, str], bool]) -> list[str]:
        """The names of ``shapes`` (name -> shape of the tensors at hand) to write; raises
        `CheckpointError` if ``from_pretrained`` would misread them. ``same(a, b)`` tells whether
        two tensors hold equal values (see [Note: checking a folder before writing it])."""
        problems = [f"'{present[0]}' is tied to '{g[0]}' in the config's {self.architecture}, but only "
                    f"'{present[0]}' is here; save it under '{g[0]}' (the name save_pretrained keeps)"
                    for g in self.ties if g[0] not in shapes and (present := [n for n in g if n in shapes])]
        drop = {n for group in self.ties for n in group[1:] if n in shapes}
        missing = [n for n in self.expected if n not in shapes
                   and not any(n in g and g[0] in shapes for g in self.ties)]
        unexpected = [n for n in shapes if n not in self.expected]
        wrong = [f"{n}: {list(shapes[n])} here, {list(self.expected[n])} in the config's {self.architecture}"
                 for n in shapes if n in self.expected and tuple(shapes[n]) != self.expected[n]]
        if missing:
            problems.append(f"{len(missing)} tensors the config's {self.architecture} has are missing (from_pretrained "
                            f"would initialise them randomly): {missing[:8]}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensors are not in the config's {self.architecture} (from_pretrained "
                            f"would ignore them; optimizer state? pass prefix 'model/'): {unexpected[:8]}")
        if wrong:
            problems.append(f"{len(wrong)} tensors have another shape than the config says (a config of "
                            f"another model size?): {wrong[:8]}")
        if not problems:
            for group in self.ties:
                for n in (n for n in group[1:] if n in drop):
                    if not same(group[0], n):
                        problems.append(f"the config ties '{n}' to '{group[0]}' but their values differ (trained "
                                        "untied?): set tie_word_embeddings to false in the config, or untie")
        if problems:
            raise CheckpointError("refusing to write a Hugging Face folder that from_pretrained would misread:\n    "
                                  + "\n    ".join(problems))
        return [n for n in shapes if n not in drop]

    def write(self, folder: str) -> None:
        write_json(os.path.join(folder, CONFIG_FILE), self.text)
        for name, data in self.extra.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)


def _config_object(source: Any):
    try:
        import transformers
    except ImportError:
        raise CheckpointError("writing a Hugging Face folder checks the tensors against the config's model, which "
                              "needs transformers: pip install transformers") from None
    extra: dict[str, bytes] = {}
    if isinstance(source, transformers.PretrainedConfig):
        return transformers, source, source.to_json_string(), extra
    if isinstance(source, dict):
        d = dict(source)
    else:
        path = os.fspath(source)
        file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise CheckpointError(f"config source {path} is neither a config.json file nor a folder holding one; "
                                  "pass the config.json of the model (or the folder save_pretrained wrote)")
        with open(file) as f:
            try:
                d = json.load(f)
            except ValueError as e:
                raise CheckpointError(f"{file} is not valid JSON ({e})") from None
        for name in _EXTRA_FILES if os.path.isdir(path) else ():
            if os.path.isfile(os.path.join(path, name)):
                with open(os.path.join(path, name), "rb") as f:
                    extra[name] = f.read()
    if not isinstance(d.get("model_type"), str):
        raise CheckpointError("the config has no 'model_type'; pass a config.json written by transformers")
    rest = {k: v for k, v in d.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(d["model_type"], **rest)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"transformers cannot build a config of model_type {d['model_type']!r}: {e}") from None
    return transformers, config, json.dumps(d, indent=2, sort_keys=True) + "\n", extra


def read_config(source: Any) -> HFConfig:
    """An `HFConfig` from a ``config.json`` path, a folder holding one (its
    ``generation_config.json`` is copied too), a dict, or a transformers ``PretrainedConfig``."""
    transformers, config, text, extra = _config_object(source)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise CheckpointError(f"the config names architectures={archs!r}, not a transformers model class; set "
                              "'architectures' (e.g. [\"LlamaForCausalLM\"]) so from_pretrained and this check know "
                              "which model the tensors are for")
    with torch.device("meta"):
        model = cls(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    order = list(expected)
    ties = tuple(tuple(sorted(g, key=order.index)) for g in by_param.values() if len(g) > 1
                 and all(n in expected for n in g))
    return HFConfig(archs[0], text, expected, ties, extra)


def model_prefix(keys, prefix: str | None) -> str:
    """The prefix of a checkpoint's model tensors: ``prefix`` if given; else ``"model/"`` when
    keys start with it, ``""`` for a bare model state dict, and an error when there are only
    other groups (e.g. ``optim/``), so optimizer state never lands in the weights."""
    if prefix is not None:
        return prefix
    keys = list(keys)
    if any(k.startswith("model/") for k in keys):
        return "model/"
    groups = sorted({k.split("/", 1)[0] for k in keys if "/" in k})
    if groups:
        raise CheckpointError(f"the checkpoint has no 'model/' tensors, only the groups {groups}; pass the prefix "
                              "of the model's tensors (--prefix GROUP/), or --prefix '' for all of them")
    return ""


def group_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def shard_names(n: int, hf: bool) -> list[str]:
    """File names of ``n`` files: transformers' names for a folder with a config, otherwise
    ``tensors-...`` names that ``from_pretrained`` does not pick up."""
    if hf and n == 1:
        return ["model.safetensors"]
    stem = "model" if hf else "tensors"
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def index_file_name(n: int, hf: bool) -> str | None:
    """The index to write next to ``n`` files (None: a single ``model.safetensors``)."""
    return (HF_INDEX_FILE if n > 1 else None) if hf else TENSORS_INDEX_FILE


def write_index(folder: str, name: str | None, weight_map: dict[str, str], total: int) -> None:
    if name is not None:
        write_json(os.path.join(folder, name),
                   json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")


def save_hf_folder(model: nn.Module | dict, out: str | os.PathLike, *, config: Any = None,
                   max_shard_bytes: int = 5 << 30, extra_files: dict[str, bytes] | None = None,
                   replaceable: Callable[[Any, str], bool] | None = None,
                   own: Callable[[Any, str], set[str]] | None = None) -> list[str]:
    """Write ``model`` (a module, sharded or not, or its state dict) as a complete
    ``save_pretrained``-style folder ``out``; collective. Returns the weight file names.

    ``config``: as `read_config`; default ``model.config`` of a transformers model. Checked
    as in [Note: checking a folder before writing it] before anything is written. Full
    tensors are gathered one at a time (``DTensor.full_tensor()``) and written by rank 0,
    which never holds more than one full tensor beyond its shards; ``out`` appears complete
    or not at all. ``extra_files`` (name -> bytes) are written next to ``config.json``;
    ``replaceable`` / ``own``: which existing folder at ``out`` may be replaced and which of its
    files are the model's (the others are moved into the new folder), as ``_commit.commit``
    (default: only a shardwise checkpoint or an empty folder; `save_pretrained` passes its own).
    """
    rank, _ = rank_and_world()
    state = model.state_dict() if isinstance(model, nn.Module) else model
    if config is None and isinstance(model, nn.Module):
        config = _with_architecture(getattr(model, "config", None), model)
    plan, error, hf = None, None, None
    try:  # on every rank: `same` may gather (the same calls everywhere, the check being deterministic)
        if config is None:
            raise CheckpointError("save_hf_folder needs a config (config.json, its folder, a dict or a "
                                  "PretrainedConfig): without one from_pretrained builds a default model")
        if rank == 0:
            check_target(PosixStorage(), os.path.abspath(os.fspath(out)), replaceable)
        hf = read_config(config)
        if extra_files:
            hf = dataclasses.replace(hf, extra={**hf.extra, **extra_files})
        shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        view = expert_view(hf.architecture, shapes)  # [Note: expert names in a Hugging Face folder]
        keys = hf.select(view.shapes, lambda a, b: _same(state[view.source.get(a, a)], state[view.source.get(b, b)]))
        parts = {p.name: p for k in keys for p in view.parts[k]}
        sizes = {n: p.box.numel * state[p.source].element_size() for n, p in parts.items()}
        plan = {"shards": group_shards(sizes, max_shard_bytes),
                "parts": {n: [p.source, list(p.box.offsets), list(p.box.sizes), list(p.shape)] for n, p in parts.items()}}
    except Exception as e:
        error = e
    agree(error, f"writing a Hugging Face folder to {os.fspath(out)}")
    plan = broadcast_json(plan, src=0)
    shards, parts_of = plan["shards"], plan["parts"]
    names = shard_names(len(shards), True)
    gathered: dict[str, torch.Tensor] = {}  # the last few full sources (one MoE block's experts)
    tmp = token = None
    failed: BaseException | None = None  # rank 0's write error: it keeps joining the gathers, then all raise

    def on_rank0(step: Callable[[], Any]) -> Any:
        nonlocal failed
        if rank != 0 or failed is not None:
            return None
        try:
            return step()
        except Exception as e:
            failed = e
            return None

    if rank == 0:
        token = secrets.token_hex(4)
        tmp = temp_dir_for(PosixStorage(), os.path.abspath(os.fspath(out)), token)
        on_rank0(lambda: os.makedirs(tmp))
    weight_map: dict[str, str] = {}
    for name, group in zip(names, shards):
        writer = on_rank0(lambda: StreamingWriter(os.path.join(str(tmp), name),
                                                  [(k, state[parts_of[k][0]].dtype, tuple(parts_of[k][3])) for k in group],
                                                  {"format": "pt"}))
        order = broadcast_json(writer.keys if writer is not None else list(group), src=0)
        for k in order:
            src, offsets, sizes_k, _ = parts_of[k]
            if src not in gathered:
                if len(gathered) >= 4:
                    gathered.pop(next(iter(gathered)))
                t = state[src]
                with torch.no_grad():
                    gathered[src] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            full = region(gathered[src], offsets, sizes_k)
            if writer is not None and failed is None:
                on_rank0(lambda: writer.append(full.cpu().contiguous()))
            weight_map[k] = name
        if writer is not None:
            if failed is None:
                on_rank0(writer.close)
            else:
                writer.abort()

    def finish() -> None:
        assert tmp is not None and token is not None and hf is not None
        write_index(tmp, index_file_name(len(names), True), weight_map, sum(sizes.values()))
        hf.write(tmp)
        commit(PosixStorage(), tmp, os.path.abspath(os.fspath(out)), token, replaceable, own)

    on_rank0(finish)
    if failed is not None and tmp is not None:
        remove_temp(PosixStorage(), tmp)  # nothing half-written is left next to ``out``
    agree(failed, f"writing a Hugging Face folder to {os.fspath(out)}")  # every rank raises rank 0's error, none waits
    return names


def _with_architecture(config, model: nn.Module):
    """``config`` naming ``model``'s transformers class when it names none (a config built in code)."""
    if config is None or getattr(config, "architectures", None):
        return config
    try:
        import transformers
    except ImportError:
        return config
    cls = next((c for c in type(model).__mro__ if getattr(transformers, c.__name__, None) is c), None)
    if cls is not None:
        config = copy.deepcopy(config)
        config.architectures = [cls.__name__]
    return config


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values; collective when either is a DTensor (compares shards when laid out alike)."""
    with torch.no_grad():
        if isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements \
                and a.device_mesh == b.device_mesh and a.shape == b.shape:
            ok = torch.tensor([int(torch.equal(a.to_local(), b.to_local()))], device=collective_device())
            if is_distributed():
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            return bool(ok.item())
        fa = a.full_tensor() if isinstance(a, DTensor) else a
        fb = b.full_tensor() if isinstance(b, DTensor) else b
        return fa.shape == fb.shape and torch.equal(fa.cpu(), fb.cpu())
