"""The transformers config written next to a Hugging Face folder's weights, and the check that
``from_pretrained`` will read those weights as the config's model.

[Note: checking a folder before writing it]
`HFConfig.select` builds the config's architecture on the meta device and compares its state
dict with the tensors to write: every expected name with its shape (any dtype), no other name,
and of a tied group only the first written, after checking the others hold the same values. Any
difference raises `CheckpointError` before a file is written. Needs ``transformers``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .._base import CheckpointError
from .._storage import PosixStorage

__all__ = ["CONFIG_FILE", "HFConfig", "read_config", "with_architecture", "write_json"]


def write_json(path: str, text: str) -> None:
    """Write ``text`` to the local file ``path`` atomically (``Storage.write_atomic``)."""
    PosixStorage().write_atomic(path, text.encode())


CONFIG_FILE = "config.json"
_EXTRA_FILES = ("generation_config.json",)


@dataclass(frozen=True)
class HFConfig:
    """A transformers config to write next to the weights (``text``, ``extra`` files) and what its
    model expects (``expected`` name -> shape; ``ties``: name groups, the kept one first)."""

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


def with_architecture(config, model: nn.Module):
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
