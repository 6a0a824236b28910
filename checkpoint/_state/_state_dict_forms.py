"""The shapes torch DCP's state-dict helpers give a state dict, for `_state_dict`.

* **Names** (`canonical_names`): keys as torch's DCP names them, without the parts wrappers add
  (``_orig_mod`` of ``torch.compile``, ``module`` of DDP, ``_checkpoint_wrapped_module``);
  setting accepts both.
* **Submodules** (``submodules=``): only the keys under those modules, with or without their
  prefix (``keep_submodule_prefixes``).
* **Frozen parameters** (``ignore_frozen_params=True``): left out of the model state dict.
* **Several optimizers**: one state dict, ``"state"`` the union keyed by FQN and
  ``"param_groups"`` every optimizer's groups in order; setting gives each optimizer its own.
* **Flat optimizer state dict** (``flatten_optimizer_state_dict=True``): ``state.<fqn>.<name>``
  and ``param_groups.<fqn>.<option>`` keys, so a pipeline stage loads just its keys; setting
  accepts either form (no ``"state"`` key means flat).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .._base import CheckpointError, is_compiled_module

__all__ = ["as_optimizers", "canonical_names", "flatten_optim", "merge_optims", "select_model_keys", "share_tied", "split_optim",
           "unflatten_optim"]


def as_optimizers(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    """One optimizer or an iterable of them, as a tuple."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    try:
        out = tuple(optimizers)
    except TypeError:
        raise TypeError(f"optimizers must be a torch.optim.Optimizer or an iterable of them, got "
                        f"{type(optimizers).__name__}") from None
    bad = [type(o).__name__ for o in out if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {bad}")
    return out


def _wrapper_part(module: nn.Module | None, part: str) -> bool:
    return part == "_checkpoint_wrapped_module" or (part == "module" and isinstance(module, DistributedDataParallel)) \
        or (part == "_orig_mod" and is_compiled_module(module))


def canonical_names(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` (state-dict keys, parameter or module names of ``model``) to its name
    without the parts wrappers add (module docstring), as torch's ``_get_fqns`` does."""
    out = {}
    for name in names:
        kept: list[str] = []
        cur: nn.Module | None = model
        for part in name.split(".") if name else []:
            if not _wrapper_part(cur, part):
                kept.append(part)
            cur = cur._modules.get(part) if isinstance(cur, nn.Module) else None
        out[name] = ".".join(kept)
    return out


def share_tied(model: nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with the names of one tied parameter (one ``Parameter`` reached by two names, e.g.
    an embedding and a head) holding one tensor object: ``state_dict()`` detaches each name
    separately, and a full state dict must gather such a tensor once and keep it one tensor (so
    ``save_pretrained`` and safetensors see the tie). Decided from the module, the same on
    every rank."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first and name in sd and first[id(p)] in sd:
            sd[name] = sd[first[id(p)]]
        first.setdefault(id(p), name)
    return sd


def select_model_keys(model: nn.Module, sd: dict[str, Any], submodules: Iterable[nn.Module] | None,
                      keep_prefixes: bool, ignore_frozen: bool) -> dict[str, Any]:
    """``sd`` (``model.state_dict()``) with canonical keys, restricted as the module docstring says."""
    if ignore_frozen:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                sd.pop(name, None)
    names = canonical_names(model, sd)
    sd = {names[k]: v for k, v in sd.items()}
    if submodules is None:
        return sd
    wanted = {id(m) for m in submodules}
    modules = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if id(m) in wanted]
    short = canonical_names(model, [name for name, _ in modules])
    prefixes = [f"{short[name]}." if short[name] else "" for name, _ in modules]
    if len(prefixes) < len(wanted):
        raise CheckpointError(f"{len(wanted) - len(set(prefixes))} of the given submodules are not modules of the "
                              f"given {type(model).__name__}; pass modules from model.modules()")
    out = {}
    for key, value in sd.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                out[key if keep_prefixes else key[len(prefix):]] = value
    return out


def merge_optims(osds: list[dict[str, Any]]) -> dict[str, Any]:
    """Several FQN-keyed optimizer state dicts as one."""
    if len(osds) == 1:
        return osds[0]
    state: dict[str, Any] = {}
    groups: list[Any] = []
    for osd in osds:
        state.update(osd["state"])
        groups.extend(osd["param_groups"])
    return {"state": state, "param_groups": groups}


def split_optim(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The part of a merged optimizer state dict that belongs to the optimizer of ``names``."""
    mine = set(names)
    groups = [g for g in osd.get("param_groups", []) if mine & set(g.get("params", []))]
    return {"state": {k: v for k, v in osd.get("state", {}).items() if k in mine}, "param_groups": groups}


def _flat_into(out: dict[str, Any], prefix: str, value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat_into(out, f"{prefix}.{k}", v)
    else:
        out[prefix] = value


def flatten_optim(osd: dict[str, Any]) -> dict[str, Any]:
    """DCP's flat form of an FQN-keyed optimizer state dict (module docstring)."""
    out: dict[str, Any] = {}
    for fqn, state in osd["state"].items():
        _flat_into(out, f"state.{fqn}", state)
    for group in osd["param_groups"]:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = v
    return out


def _nested(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(prefix + "."):
            *parents, last = key[len(prefix) + 1:].split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
    return out


def unflatten_optim(flat: dict[str, Any], optim: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """The FQN-keyed optimizer state dict of ``optim`` (whose parameters are ``names``, in
    ``param_groups`` order) out of a flat one; raises naming a missing key."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    at = 0
    for g, group in enumerate(optim.param_groups):
        fqns = names[at:at + len(group["params"])]
        at += len(group["params"])
        out: dict[str, Any] = {"params": fqns}
        for k in group:
            if k == "params":
                continue
            values = {fqn: flat.get(f"param_groups.{fqn}.{k}", _MISSING) for fqn in fqns}
            got = [v for v in values.values() if v is not _MISSING]
            if not got:
                raise CheckpointError(f"the flat optimizer state dict has no 'param_groups.{fqns[0] if fqns else '?'}"
                                      f".{k}' (param_groups[{g}] option {k!r})")
            if any(v != got[0] for v in got):
                raise CheckpointError(f"the flat optimizer state dict gives param_groups[{g}] option {k!r} different "
                                      f"values for its parameters: {values}")
            out[k] = got[0]
        groups.append(out)
        for fqn, p in zip(fqns, group["params"]):
            sub = _nested(flat, f"state.{fqn}")
            if sub:
                state[fqn] = sub
            elif optim.state.get(p):
                raise CheckpointError(f"the flat optimizer state dict has no 'state.{fqn}.*' keys for parameter "
                                      f"'{fqn}', which has optimizer state")
    return {"state": state, "param_groups": groups}


_MISSING = object()
