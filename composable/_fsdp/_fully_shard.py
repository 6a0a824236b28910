"""``fully_shard``: the public entry point and the state-dict hooks it registers on a unit.
Its inputs are checked in ``_unit_inputs.py``; the ``FSDPModule`` methods are ``_module.py``'s."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._common import OWNER_ATTR as _OWNER_ATTR
from ._common import FullyShardUsageError
from ._param_group import ParamGroup
from ._policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._module import FSDPModule, UnshardHandle, share_comm_ctx
from ._spmd import spmd_mesh, to_tp_dtensor
from ._unit_inputs import check_mesh as _check_mesh
from ._unit_inputs import check_reshard_after_forward as _check_reshard_after_forward
from ._unit_inputs import check_params as _check_params
from ._unit_inputs import collect_params as _collect_params
from ._unit_inputs import default_mesh as _default_mesh
from ._unit_inputs import move_buffers as _move_buffers
from ._unit_inputs import shard_placement as _shard_placement
from ._state import FSDPState, get_state, units_under
from ._fsdp_class import fsdp_class as _fsdp_class

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx",
           "FullyShardUsageError"]


def _unit(module: nn.Module) -> FSDPState:
    state = get_state(module)
    assert state is not None, "the hook is registered on a fully_shard unit"
    return state


def _load_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Reshard first; a sharded entry from another layout (another mesh shape or ranks: a replica
    group of another size or shape, whose shards are other slices) is refused in one line naming
    both, before anything is copied (copying fails per parameter, or waits for ranks never there)."""
    unit = _unit(module)
    unit.reshard_for_update("load_state_dict")
    ours = {id(sp.sharded) for sp in unit.group.params} if unit.group is not None else set()
    for name, p in module.named_parameters():
        theirs = state_dict.get(prefix + name)
        if id(p) in ours and isinstance(theirs, DTensor) and isinstance(p, DTensor) and _layout(theirs) != _layout(p):
            raise ValueError(f"load_state_dict: '{prefix + name}' is sharded {_layout(theirs, True)} but this model "
                             f"shards it {_layout(p, True)}: a sharded state dict loads only into its own layout; "
                             f"save it with shardwise.checkpoint and load that (it reshards), or use a full state dict")


def _layout(t: DTensor, placements: bool = False) -> str:
    mesh = t.device_mesh
    where = f"the {'x'.join(map(str, mesh.shape))} mesh of ranks {mesh.mesh.tolist()}"
    return f"{tuple(t.placements)} over {where}" if placements else where


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    _unit(module).readopt(partial_ok=True)  # a list unit's modules load one after the other


_UNIT_ATTR = "_shardwise_param_unit"  # on a module holding a unit's parameters: the unit's module


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """``state_dict()`` holds the sharded DTensors whenever it is called: a unit left unsharded
    by a forward (the root by default, ``reshard_after_forward=False``) reshards first, as FSDP2
    does; its next backward gathers again. Called from another thread than the one that ran the
    root's last forward (torchft's quorum thread while the step runs), it changes nothing: the
    post-hook puts the sharded parameters in ([Note: a state dict read from another thread]).
    Registered on every module that holds one of the unit's parameters, so
    ``submodule.state_dict()`` sees shards too; the unit is found through the module (a copied
    module finds its own copy)."""
    state = _unit(module.__dict__[_UNIT_ATTR])
    if state.ctx is None or state.ctx.thread in (None, threading.get_ident()):
        state.reshard_for_update("state_dict()")


# [Note: a state dict read from another thread]
# Resharding from another thread would change what a running step's next op sees (FSDP2's hook
# does: "mixed torch.Tensor and DTensor"). The sharded DTensors are always valid, so the post-hook
# replaces each of the unit's parameter entries by the sharded one (detached unless keep_vars).
def _state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    group = _unit(module.__dict__[_UNIT_ATTR]).group
    assert group is not None, "the hook is registered on modules holding a unit's parameters"
    for sp in group.params:
        for m, name in sp.uses:
            key = prefix + name
            if m is module and key in state_dict and state_dict[key] is not sp.sharded:
                state_dict[key] = sp.sharded if isinstance(state_dict[key], nn.Parameter) else sp.sharded.detach()


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:  # the module (or list) given, its classes now also FSDPModule
    """Shard the parameters of ``module`` (or of a list of modules, as one unit) over ``mesh``.

    Every parameter under ``module`` that is not already owned by a unit below it becomes an
    ``nn.Parameter`` wrapping a DTensor: ``(Shard(0),)`` on a 1-D mesh (FSDP / ZeRO-3) or
    ``(Replicate(), Shard(0))`` on a 2-D replicate x shard mesh (HSDP), split along dim 0 with
    ``torch.chunk`` semantics. The call makes one *unit*: one all-gather before its forward (and
    again before its backward when resharded), one reduce-scatter of its gradients per backward
    (+ one all-reduce over the replicate axis for HSDP). Apply it per block, bottom-up, then on
    the root; build the optimizer afterwards.

    Args:
        mesh: 1-D or 2-D ``DeviceMesh``; default: a 1-D mesh over the default process group.
        reshard_after_forward: True frees the unsharded parameters after forward (ZeRO-3);
            False keeps them until after backward (ZeRO-2); an int ``k`` keeps ``1/k`` of them and
            all-gathers over ``k`` consecutive ranks in backward. None: True, except False for the
            root (the first unit to run forward).
        shard_placement_fn: called once per original parameter; returns ``Shard(d)`` to shard
            it on dim ``d`` instead of dim 0 (any ``d`` and size, ``torch.chunk`` splits), or
            None for ``Shard(0)`` ([Note: the shard layout seam]). torch 2.13's
            ``ShardPlacementResult`` is taken when its mesh is ``mesh``; another mesh is a
            ``NotImplementedError`` (shard that module as a unit first).
        mp_policy, offload_policy: see ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``.
        ignored_params: parameters left as they are (not sharded, not reduced).
        dp_mesh_dims: a `DataParallelMeshDims` naming the data-parallel axes of ``mesh`` when
            ``mesh`` is the whole SPMD mesh (e.g. ``("dp", "tp")``) and the parameters are
            DTensors on it with ``Replicate()`` on those axes (as after ``parallelize_module``
            on the whole mesh): fully_shard then shards over ``mesh[shard]`` (HSDP with
            ``replicate``) and keeps the parameters' other placements.

    Returns the module, whose class now also derives from ``FSDPModule``.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard takes an nn.Module or a non-empty list of nn.Modules")
    label = type(modules[0]).__name__ if len(modules) == 1 else f"[{', '.join(type(m).__name__ for m in modules)}]"
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard({type(m).__name__}): fully_shard does not support containers that do not implement "
                "forward (its hooks run around the module's forward, which a container never runs). Shard its "
                "modules as one unit with fully_shard(list(container)), or each one separately."
            )
    for m in modules:
        if get_state(m) is not None:
            raise FullyShardUsageError(
                f"fully_shard({type(m).__name__}): this module is already sharded (fully_shard was called on it "
                "before). Each distinct composable distributed API can only be applied to a module once. Call "
                "fully_shard once per module; to change reshard_after_forward use "
                "module.set_reshard_after_forward(...)."
            )
    mesh = _default_mesh() if mesh is None else mesh
    if dp_mesh_dims is not None:
        mesh = spmd_mesh(mesh, dp_mesh_dims)
    _check_mesh(mesh)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    ignored = {id(p) for p in (ignored_params or ())}
    entries = originals = _collect_params(modules, ignored)
    if dp_mesh_dims is not None:
        entries = [(fqn, to_tp_dtensor(p, fqn, dp_mesh_dims), uses) for fqn, p, uses in entries]
    _check_params(entries, mesh, label)
    placements = [_shard_placement(shard_placement_fn, fqn, p, label, mesh) for fqn, p, _ in entries]
    _move_buffers(modules, mesh, mp_policy.buffer_dtype)
    group = ParamGroup(entries, mesh, mp=mp_policy, offload=offload_policy, label=label,
                       placements=placements) if entries else None
    state = FSDPState(modules, group, mesh, reshard_after_forward, mp_policy)  # registers itself on the modules
    for s in units_under(modules):  # the units below: this one is their parent ([Note: the traced unit])
        if s is not state and s.parent is None:
            s.parent = state
    if group is not None:
        for (fqn, p, _), sp in zip(originals, group.params):
            sp.owner = f"'{fqn}' of the unit fully_shard({label})"
            setattr(p, _OWNER_ATTR, sp.owner)
            setattr(sp.sharded, _OWNER_ATTR, sp.owner)
            sp.register(unsharded=False)
    if group is not None:
        for m in {id(m): m for sp in group.params for m, _ in sp.uses}.values():
            m.__dict__[_UNIT_ATTR] = modules[0]
            m.register_state_dict_pre_hook(_state_dict_pre_hook)
            m.register_state_dict_post_hook(_state_dict_post_hook)
    for m in modules:
        # load_state_dict(assign=True) replaces parameters: re-adopt them (the hooks find the
        # state on the module, so a copied module does not reach back to this one)
        m.register_load_state_dict_pre_hook(_load_pre_hook)
        m.register_load_state_dict_post_hook(_load_post_hook)
        m.__class__ = _fsdp_class(type(m))
    return module


def _state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``, as FSDP2 has it: the unit state `fully_shard` attached to
    ``module`` (one object per call, shared by the modules of a list-form call), or None. Its
    attributes are shardwise's, not torch's ``FSDPState``'s; use the ``FSDPModule`` methods."""
    return get_state(module)


setattr(fully_shard, "state", _state_of)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` (e.g. ``generate``) run like ``forward``: the unit
    is unsharded before it and resharded after it, exactly as around ``module(...)``. On a
    module that is not a ``fully_shard`` unit it does nothing (as FSDP2: one script can call it
    with or without sharding)."""
    state = get_state(module)
    if state is None:
        return
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    wrapped.__wrapped__ = method  # type: ignore[attr-defined]  # as functools.wraps sets it
    object.__setattr__(module, method_name, wrapped)
