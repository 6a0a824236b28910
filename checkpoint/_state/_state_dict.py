"""Model and optimizer state dicts keyed by parameter name, for sharded and plain modules alike.

Names and layouts follow torch DCP's state-dict helpers, so code switches with one import:

* ``get_model_state_dict(model)`` is ``model.state_dict()``: parameters and persistent buffers
  by FQN, DTensors for sharded parameters, sharing storage with the model.
* ``get_optimizer_state_dict(model, optim)``: torch's optimizer state dict with parameter
  indices replaced by FQNs, so it reshards like the parameters; the state is created first
  (`init_optimizer_state`) so the dict has every tensor a load can fill.
* ``set_model_state_dict`` / ``set_optimizer_state_dict`` put such dicts back;
  ``get_state_dict`` / ``set_state_dict`` do both, for one optimizer or several
  (``_state_dict_forms``).

`StateDictOptions` has DCP's fields and meanings; full tensors are gathered, and with
``broadcast_from_rank0`` sent, one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from torch.distributed.tensor import DTensor

from .._base import CheckpointError, broadcast_json, collective_device, is_distributed, rank_and_world
from ._flatten import to_json_value
from ._full_state import gather_full, scatter_full, to_cpu
from ._state_dict_forms import (as_optimizers, canonical_names, flatten_optim, merge_optims, select_model_keys,
                                share_tied, split_optim, unflatten_optim)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "init_optimizer_state",
]


@dataclass(frozen=True)
class StateDictOptions:
    """How the state dict helpers treat sharded tensors.

    The fields and meanings of torch DCP's ``StateDictOptions``:

    * ``full_state_dict``: get full tensors instead of shards / set from full tensors.
    * ``cpu_offload``: on get, tensors go to CPU; with ``full_state_dict`` only rank 0 keeps
      them (the other ranks get ``{}``), without it each rank's shards are copied to CPU.
    * ``ignore_frozen_params``: on get, parameters with ``requires_grad=False`` are left out.
    * ``keep_submodule_prefixes``: with ``submodules=`` on get, keys keep the submodule's
      prefix (``pretrain.layer1.weight``, the default) or lose it (``layer1.weight``).
    * ``strict``: on set, every key of the model (or optimizer) must be given.
    * ``broadcast_from_rank0``: with ``full_state_dict`` on set, only rank 0's dict is read.
    * ``flatten_optimizer_state_dict``: the optimizer state dict has one level of keys
      (``state.<fqn>.<name>``, ``param_groups.<fqn>.<option>``; ``_state_dict_forms``); set
      accepts either form whatever this says.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False

    def __post_init__(self) -> None:
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError("StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True (rank 0 holds "
                             "the full state dict and sends each rank its shards)")


def _fqns(model: nn.Module) -> dict[int, str]:
    named = list(model.named_parameters())
    canonical = canonical_names(model, [name for name, _ in named])
    return {id(p): canonical[name] for name, p in named}


def _wrapped_keys(model: nn.Module, sd: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """``sd`` keyed as ``model.state_dict()`` (``current``) is: canonical names (as
    `get_model_state_dict` gives them) back to the wrapped ones; wrapped names stay."""
    back = {c: k for k, c in canonical_names(model, current).items()}
    return {k if k in current else back.get(k, k): v for k, v in sd.items()}


def _optim_params(model: nn.Module, optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    fqns = _fqns(model)
    out = []
    for g, group in enumerate(optim.param_groups):
        for p in group["params"]:
            if id(p) not in fqns:
                raise CheckpointError(
                    f"the optimizer's param_groups[{g}] holds a parameter of shape {list(p.shape)} that is not a "
                    f"parameter of the given {type(model).__name__}; build the optimizer from model.parameters() "
                    "after sharding the model"
                )
            out.append((fqns[id(p)], p))
    return out


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create the lazily initialized state of parameters that have none.

    Runs one ``optim.step()`` with every learning rate set to 0 and zero gradients on exactly
    the parameters without state (others get no gradient, so ``step`` skips them). For AdamW,
    SGD and the other ``torch.optim`` optimizers this leaves the parameters bit-for-bit
    unchanged; the learning rates and any existing gradients are restored afterwards.
    """
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    missing = [p for p in params if not optim.state.get(p)]
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optim.param_groups]
    try:
        for g in optim.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        todo = {id(p) for p in missing}
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in todo else None
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _finish(sd: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    if options.full_state_dict:
        return gather_full(sd, rank0_only=options.cpu_offload, cpu=options.cpu_offload)
    return to_cpu(sd) if options.cpu_offload else sd


def get_model_state_dict(model: nn.Module, *, submodules: Iterable[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """``model``'s parameters and persistent buffers by FQN (see the module docstring); with
    ``submodules`` only those modules' keys (``StateDictOptions.keep_submodule_prefixes``)."""
    options = options or StateDictOptions()
    sd = select_model_keys(model, share_tied(model, model.state_dict()), submodules, options.keep_submodule_prefixes,
                           options.ignore_frozen_params)
    return _finish(sd, options)


def _one_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    names = [fqn for fqn, _ in _optim_params(model, optim)]
    init_optimizer_state(optim)
    osd = optim.state_dict()
    return {
        "state": {names[i]: v for i, v in osd["state"].items()},
        "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]],
    }


def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             *, submodules: Iterable[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The state of ``optimizers`` (one or several, merged) keyed by parameter FQN (see the
    module docstring); creates missing state. ``submodules`` is accepted for DCP's signature
    and, as there, does not restrict the optimizer state."""
    options = options or StateDictOptions()
    out = merge_optims([_one_optim_state_dict(model, o) for o in as_optimizers(optimizers)])
    if options.flatten_optimizer_state_dict:
        out = flatten_optim(out)
    return _finish(out, options)


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   submodules: Iterable[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``, DCP's call."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], *,
                   model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any],
                   options: StateDictOptions | None = None):
    """The counterpart of `get_state_dict` (DCP's call): sets the optimizers' state, then the
    model's; returns ``model.load_state_dict``'s missing/unexpected keys."""
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return set_model_state_dict(model, model_state_dict, options=options)


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None):
    """Load ``model_state_dict`` (from `get_model_state_dict`, or full with ``full_state_dict``)
    into ``model``; returns ``model.load_state_dict``'s missing/unexpected keys. With
    ``full_state_dict``, a model still on the meta device gets real tensors (`_materialized`)."""
    options = options or StateDictOptions()
    current = model.state_dict()
    model_state_dict = _wrapped_keys(model, model_state_dict, current)
    if options.full_state_dict:
        current, assign = _materialized(current)
        source = model_state_dict if options.strict else {k: v for k, v in model_state_dict.items() if k in current}
        target = current if options.strict else {k: v for k, v in current.items() if k in source}
        scatter_full(target, source, from_rank0=options.broadcast_from_rank0, where="the full model state dict")
        if assign and not options.strict:
            current = target  # only what was filled replaces the meta tensors
        return model.load_state_dict(current, strict=options.strict, assign=assign)
    return model.load_state_dict(model_state_dict, strict=options.strict)


def _materialized(sd: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``sd`` with each meta tensor replaced by an empty one of its (local) shape, on the device of
    the others (else its mesh's, else the collective device), and whether there was one: a full
    state dict set into a model still on the meta device then loads with ``assign=True``, as
    torch's DCP does (``fully_shard`` re-adopts the assigned shards)."""
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    if not any(t.device.type == "meta" for t in tensors):
        return sd, False
    real = {t.device for t in tensors if t.device.type != "meta"}
    if len(real) > 1:
        raise CheckpointError(f"set_model_state_dict: the model's tensors are on the meta device and on several others "
                              f"{sorted(map(str, real))}; move them to one device first")

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return t
        if isinstance(t, DTensor):
            device = next(iter(real)) if real else torch.device(t.device_mesh.device_type)
            local = torch.empty_like(t.to_local(), device=device)
            return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                                      run_check=False)
        return torch.empty_like(t, device=next(iter(real)) if real else
                                collective_device() if is_distributed() else torch.device("cpu"))

    return {k: empty(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}, True


def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                             optim_state_dict: dict[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (from `get_optimizer_state_dict`, nested or flat)
    into ``optimizers`` (one or several: each takes the groups and state of its parameters).
    The optimizer's own form (``optim.state_dict()``, parameters by position) is accepted too,
    as torch's DCP does: each optimizer reads the positions as its own parameters."""
    options = options or StateDictOptions()
    optims = as_optimizers(optimizers)
    for optim in optims:
        names = [fqn for fqn, _ in _optim_params(model, optim)]
        part = optim_state_dict
        if _id_keyed(part):  # optim.state_dict()'s own form: parameters by position in this optimizer
            part = _by_name(part, names)
        elif part and "state" not in part:
            part = unflatten_optim(part, optim, names)
        elif part and len(optims) > 1:
            part = split_optim(part, names)
        _set_one_optim(model, optim, part, options)


def _id_keyed(osd: dict[str, Any]) -> bool:
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not isinstance(groups, list) or not groups or not isinstance(osd.get("state"), dict):
        return False
    ids = list(osd["state"]) + [i for g in groups for i in g.get("params", [])]
    return bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def _by_name(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer's own state dict (parameters by position) keyed by parameter FQN."""
    bad = [i for i in list(osd["state"]) + [i for g in osd["param_groups"] for i in g["params"]]
           if not 0 <= i < len(names)]
    if bad:
        raise CheckpointError(f"the optimizer state dict (keyed by parameter position, optim.state_dict()'s form) "
                              f"names position {bad[0]}, but the optimizer holds {len(names)} parameters")
    return {"state": {names[i]: v for i, v in osd["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]}


def _set_one_optim(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                   options: StateDictOptions) -> None:
    named = _optim_params(model, optim)
    if options.full_state_dict:
        current = _one_optim_state_dict(model, optim)
        scatter_full({"state": current["state"]}, {"state": optim_state_dict.get("state", {})},
                     from_rank0=options.broadcast_from_rank0, where="the full optimizer state dict")
        groups = optim_state_dict.get("param_groups")
        if options.broadcast_from_rank0:
            groups = broadcast_json(to_json_value(groups, "param_groups") if rank_and_world()[0] == 0 else None)
        optim_state_dict = {"state": current["state"], "param_groups": groups}
    index = {fqn: i for i, (fqn, _) in enumerate(named)}
    raw = {id(p): name for name, p in model.named_parameters()}
    index.update({raw[id(p)]: i for i, (_, p) in enumerate(named) if raw[id(p)] not in index})  # wrapped names
    unknown = [k for k in list(optim_state_dict["state"]) + [f for g in optim_state_dict["param_groups"]
                                                              for f in g["params"]] if k not in index]
    if unknown:
        raise CheckpointError(f"the optimizer state dict names parameters {sorted(set(unknown))[:5]} that the "
                              f"optimizer does not hold (it holds {list(index)[:5]}...)")
    optim.load_state_dict({
        "state": {index[k]: v for k, v in optim_state_dict["state"].items()},
        "param_groups": [dict(g, params=[index[f] for f in g["params"]]) for g in optim_state_dict["param_groups"]],
    })
