"""``fully_shard``: the public entry point, its input checks, and the ``FSDPModule`` mixin."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._compat import is_strided_shard
from .._mesh_utils import mesh_device
from ._param_group import ParamGroup
from ._errors import FullyShardUsageError
from ._policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._module import OWNER_ATTR as _OWNER_ATTR
from ._module import FSDPModule, UnshardHandle, share_comm_ctx
from ._module import check_reshard_after_forward as _check_reshard_after_forward
from ._module import readopt as _readopt
from ._module import reshard_for_update as _reshard_for_update
from ._spmd import spmd_mesh, to_tp_dtensor
from ._state import FSDPState, get_state
from ._fsdp_class import fsdp_class as _fsdp_class

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx",
           "FullyShardUsageError"]


def _unit(module: nn.Module) -> FSDPState:
    state = get_state(module)
    assert state is not None, "the hook is registered on a fully_shard unit"
    return state


def _load_pre_hook(module, *args) -> None:
    _reshard_for_update(_unit(module), "load_state_dict")


def _load_post_hook(module, incompatible_keys) -> None:
    _readopt(_unit(module))


_UNIT_ATTR = "_shardwise_param_unit"  # on a module holding a unit's parameters: the unit's module


def _state_dict_pre_hook(module, prefix, keep_vars) -> None:
    """``state_dict()`` holds the sharded DTensors whenever it is called: a unit left unsharded
    by a forward (the root by default, ``reshard_after_forward=False``) reshards first, as FSDP2
    does; its next backward gathers again. Registered on every module that holds one of the
    unit's parameters, so ``submodule.state_dict()`` sees shards too; the unit is found through
    the module (a copied module finds its own copy)."""
    _reshard_for_update(_unit(module.__dict__[_UNIT_ATTR]), "state_dict()")


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: launch with torchrun and call "
            "torch.distributed.init_process_group (or shardwise.mesh.init_distributed), "
            "or pass mesh= explicitly"
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.group.WORLD
    assert world is not None, "initialized above"
    return DeviceMesh.from_group(world, device_type)


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim in (1, 2):
        return
    names = mesh.mesh_dim_names
    head = f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}"  # FSDP2's words, for code matching them
    if names is None:
        raise ValueError(
            f"{head}: a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} without axis names. fully_shard takes the "
            "data-parallel mesh (1-D shard, or 2-D replicate x shard). Name the axes (build it with "
            "shardwise.mesh.init_mesh) and pass shardwise.mesh.data_parallel_mesh(mesh)."
        )
    raise ValueError(
        f"{head}: a {mesh.ndim}-D mesh with axes {names}; it takes the data-parallel mesh (1-D shard, or 2-D "
        "replicate x shard), e.g. mesh['dp_replicate', 'dp_shard'] or shardwise.mesh.data_parallel_mesh(mesh)."
    )


def _collect_params(modules: list[nn.Module], ignored: set[int]):
    """``[(fqn, param, uses)]`` of the parameters this unit takes: those under ``modules`` that
    are not under an existing unit, not ignored, each once however many names it has."""
    by_id: dict[int, tuple[str, nn.Parameter, list]] = {}
    order: list[int] = []

    def visit(mod: nn.Module, prefix: str, top: bool) -> None:
        if not top and get_state(mod) is not None:
            return  # a nested unit owns this subtree
        for name, p in mod._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            owner = getattr(p, _OWNER_ATTR, None)
            if owner is not None:
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' is shared with {owner}, which is already sharded. A parameter "
                    "shared between two units (e.g. an embedding tied to the output head) would be all-gathered and "
                    "reduced twice and go stale. Put every module that uses it in one unit: call fully_shard on "
                    "their common ancestor (often the root) instead of on the submodule, or pass both modules "
                    "in one list: fully_shard([embedding, head])."
                )
            if id(p) not in by_id:
                by_id[id(p)] = (fqn, p, [])
                order.append(id(p))
            by_id[id(p)][2].append((mod, name))
        for cname, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{cname}.", False)

    for i, m in enumerate(modules):
        visit(m, "" if len(modules) == 1 else f"[{i}].", True)
    return [by_id[i] for i in order]


def _check_params(entries, mesh: DeviceMesh, label: str) -> None:
    for fqn, p, _ in entries:
        if isinstance(p, DTensor) and not all(
                isinstance(x, (Shard, Replicate)) and not is_strided_shard(x) for x in p.placements):
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is a DTensor with placements {tuple(p.placements)} on a "
                f"{p.device_mesh.ndim}-D mesh; fully_shard composes with tensor parallelism on a 'tp' mesh "
                "(or expert x tensor parallelism on ('ep', 'tp')) with Shard or Replicate placements. Apply tensor parallelism first, then fully_shard on the "
                "data-parallel mesh."
            )
        if not p.is_floating_point():
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters are "
                "sharded. Register it as a buffer (module.register_buffer) or pass it in ignored_params."
            )
        if p.dim() == 0:
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is 0-d and has no dim 0 to shard. Change {fqn} to a 1D "
                "tensor with numel equal to 1 (shape (1,)), or pass it in ignored_params."
            )
        # CPU parameters move to an accelerator mesh's device (a model built on CPU, as with FSDP2);
        # any other mismatch is a mistake.
        if p.device.type not in (mesh.device_type, "meta", "cpu"):
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' is on device '{p.device.type}' but the mesh is "
                f"'{mesh.device_type}'. Move the module first (module.to('{mesh.device_type}')) or build the mesh "
                f"for '{p.device.type}'."
            )

def _shard_placement(fn, fqn: str, param, label: str) -> Shard | None:
    """What ``shard_placement_fn`` says for ``param``, checked (None: ``Shard(0)``)."""
    if fn is None:
        return None
    placement = fn(param)
    if placement is None:
        return None
    if not isinstance(placement, Shard) or is_strided_shard(placement):
        raise TypeError(f"fully_shard({label}): shard_placement_fn returned {placement!r} for '{fqn}'; return "
                        "torch.distributed.tensor.Shard(dim) or None (Shard(0))")
    ndim = (param.to_local() if isinstance(param, DTensor) else param).dim()
    if not -ndim <= placement.dim < ndim:
        raise FullyShardUsageError(
            f"fully_shard({label}): shard_placement_fn returned Shard({placement.dim}) for '{fqn}' of shape "
            f"{tuple(param.shape)}: Shard dim {placement.dim} is invalid for {ndim}D tensor; return a dim in "
            f"[-{ndim}, {ndim - 1}] (or None for Shard(0))")
    return Shard(placement.dim % ndim)


def _move_buffers(modules: list[nn.Module], mesh: DeviceMesh, dtype: torch.dtype | None) -> None:
    """Move the unit's CPU buffers (not those of nested units) to the mesh's device and cast
    its floating-point buffers to ``MixedPrecisionPolicy.buffer_dtype`` when set."""
    device = mesh_device(mesh)
    stack = list(modules)
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is None or b.device.type == "meta":
                continue
            to_device = device if b.device.type == "cpu" and device.type != "cpu" else b.device
            to_dtype = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if (to_device, to_dtype) != (b.device, b.dtype):
                m._buffers[name] = b.to(device=to_device, dtype=to_dtype)
        stack.extend(c for c in m._modules.values() if c is not None and get_state(c) is None)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
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
        shard_placement_fn: called once per parameter (the original one, before sharding);
            returns ``Shard(d)`` to shard it on dim ``d`` instead of dim 0 (e.g. the largest
            dim, or dim 1 of a wide embedding), or None for ``Shard(0)``. Any ``d`` and any
            size: uneven splits follow ``torch.chunk`` as on dim 0. Gradients, optimizer state
            and checkpoints follow the parameter's placement ([Note: the shard layout seam]).
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
    placements = [_shard_placement(shard_placement_fn, fqn, p, label) for fqn, p, _ in entries]
    _move_buffers(modules, mesh, mp_policy.buffer_dtype)
    group = ParamGroup(entries, mesh, mp=mp_policy, offload=offload_policy, label=label,
                       placements=placements) if entries else None
    FSDPState(modules, group, mesh, reshard_after_forward, mp_policy)  # registers itself on the modules
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

    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    wrapped.__wrapped__ = method  # type: ignore[attr-defined]  # as functools.wraps sets it
    object.__setattr__(module, method_name, wrapped)
