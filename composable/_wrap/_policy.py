"""``apply_fully_shard``: pick the units of a model by a policy and shard them with a strategy.

    from shardwise.composable import ShardingPolicy, apply_fully_shard

    policy = ShardingPolicy(strategy="FULL_SHARD", layer_cls="TransformerBlock")
    apply_fully_shard(model, init_mesh(dp_shard=-1), policy)   # every block, then the root

A *unit* is one ``fully_shard`` call, selected by class name, parameter count or
``_no_split_modules``; the strategy (Accelerate's names) fixes the data-parallel mesh and
``reshard_after_forward``. docs/strategies.md compares them with DeepSpeed ZeRO and FSDP1/2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist
from einops import rearrange
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardwise.mesh import MeshAxes, init_mesh, mesh_axes

from .._fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from .._replicate import replicate
from ._accelerate import APPLY_DEFAULTS, read_accelerate_config
from ._strategies import ShardingStrategy

__all__ = ["ShardingStrategy", "ShardingPolicy", "select_units", "strategy_mesh", "apply_fully_shard"]


@dataclass(frozen=True)
class ShardingPolicy:
    """Which modules become units, and how they are sharded.

    Fields:
        strategy: a `ShardingStrategy` or its name (Accelerate's ``fsdp_sharding_strategy``).
        layer_cls: class names whose instances become units: a comma-separated string
            (``"LlamaDecoderLayer,Embedding"``, Accelerate's ``fsdp_transformer_layer_cls_to_wrap``),
            or a sequence of names or classes. A module matches if its class or a base class has
            the name. Every name must match a module of the model.
        min_num_params: if > 0, a module becomes a unit when the parameters under it that are
            not already in a unit below it number at least this (Accelerate's
            ``fsdp_min_num_params``; ``ModuleList``/``ModuleDict`` are never picked by size).
        no_split_modules: also select the classes named by ``_no_split_modules`` (Hugging Face's
            convention) of the model and its submodules; at least one must be present.
        reshard_after_forward: overrides the strategy's value for every unit except the root:
            an int ``k`` keeps ``1/k`` of the gathered parameters and re-gathers over ``k``
            ranks (ZeRO++ hpZ). None: the strategy's.
        mp_policy, offload_policy: passed to every ``fully_shard`` call (Accelerate's
            ``mixed_precision`` and ``fsdp_offload_params``).

    Selectors combine by "or". With none, only the root is a unit (Accelerate's ``NO_WRAP``).
    Units are sharded children before parents, then the root, which always keeps its
    parameters from forward to backward (they are the first needed there).
    """

    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD
    layer_cls: str | tuple[str, ...] = ()
    min_num_params: int = 0
    no_split_modules: bool = False
    reshard_after_forward: bool | int | None = None
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    offload_policy: OffloadPolicy = OffloadPolicy()

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", ShardingStrategy.parse(self.strategy))
        raw = self.layer_cls.split(",") if isinstance(self.layer_cls, str) else self.layer_cls
        names = [c.__name__ if isinstance(c, type) else c for c in raw]
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"ShardingPolicy.layer_cls={self.layer_cls!r}: give class names or classes")
        object.__setattr__(self, "layer_cls", tuple(dict.fromkeys(n.strip() for n in names if n.strip())))
        n = self.min_num_params
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ShardingPolicy.min_num_params={n!r}: use an int >= 0 (0 = do not select by size)")
        raf = self.reshard_after_forward
        if raf is not None and (not isinstance(raf, int) or (not isinstance(raf, bool) and raf < 1)):
            raise ValueError(f"ShardingPolicy.reshard_after_forward={raf!r}: use None, a bool or an int >= 1")
        if not isinstance(self.mp_policy, MixedPrecisionPolicy) or not isinstance(self.offload_policy, OffloadPolicy):
            raise TypeError("ShardingPolicy: mp_policy must be a MixedPrecisionPolicy and offload_policy an "
                            "OffloadPolicy")

    @classmethod
    def from_accelerate(cls, config: dict) -> ShardingPolicy:
        """A policy from Accelerate's FSDP config (its ``fsdp_config`` keys, with or without the
        ``fsdp_`` prefix, or the whole YAML as a dict). Keys that a policy cannot carry
        (``sync_module_states``, activation checkpointing, ...) are refused unless they ask for
        the default: use ``from_accelerate_config(config).apply(model)`` for those. See
        docs/accelerate.md for every key."""
        fields = read_accelerate_config(config)
        asked = {k: fields[k] for k, default in APPLY_DEFAULTS.items() if fields.get(k, default) != default}
        if asked:
            raise ValueError(f"ShardingPolicy.from_accelerate: {asked} are not sharding-policy settings and would be "
                             "lost here; use shardwise.composable.from_accelerate_config(config).apply(model, mesh) "
                             "(and its .state_dict_options), which carries them out")
        return cls(**fields["policy"])


def _class_names(model: nn.Module, policy: ShardingPolicy) -> set[str]:
    present = sorted({c.__name__ for m in model.modules() for c in type(m).__mro__
                      if issubclass(c, nn.Module) and c is not nn.Module and not issubclass(c, FSDPModule)})
    lower = {p.lower(): p for p in present}

    def missing_error(names: list[str], what: str) -> ValueError:
        near = {n: [lower[m] for m in difflib.get_close_matches(n.lower(), lower, n=3, cutoff=0.6)] for n in names}
        hints = "; ".join(f"{n!r}: did you mean {m}?" for n, m in near.items() if m)
        return ValueError(f"apply_fully_shard: {what} {names} match no module of {type(model).__name__}. "
                          f"Classes present: {present}.{' ' + hints if hints else ''} Fix the names in "
                          "ShardingPolicy(layer_cls=...).")

    wanted = set(policy.layer_cls)
    missing = [n for n in policy.layer_cls if n not in present]
    if missing:
        raise missing_error(missing, "layer_cls")
    if policy.no_split_modules:
        declared = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
        if not declared:
            raise ValueError(f"apply_fully_shard: no_split_modules=True but {type(model).__name__} has no "
                             f"_no_split_modules; name the block classes: ShardingPolicy(layer_cls=...) of {present}")
        if not declared & set(present):
            raise missing_error(sorted(declared), "the _no_split_modules classes")
        wanted |= declared
    return wanted


def select_units(model: nn.Module, policy: ShardingPolicy) -> list[str]:
    """Qualified names of the submodules that `apply_fully_shard` makes units, in the order it
    shards them (children before parents; the root, which comes last, is not listed).

    Pure: no communication, works on any module (meta device included). Modules that are
    already units are skipped, and their parameters do not count toward ``min_num_params``.
    """
    names = _class_names(model, policy)
    units: list[str] = []
    seen_modules: set[int] = set()
    seen_params: set[int] = set()

    def visit(mod: nn.Module, fqn: str) -> int:
        """Parameters under ``mod`` not yet in a unit (each counted once)."""
        free = 0
        for cname, child in mod.named_children():
            if id(child) not in seen_modules:
                seen_modules.add(id(child))
                free += visit(child, f"{fqn}.{cname}" if fqn else cname)
        for p in mod.parameters(recurse=False):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                free += p.numel()
        if mod is model:
            return free
        if isinstance(mod, FSDPModule):
            return 0
        by_class = any(c.__name__ in names for c in type(mod).__mro__)
        by_size = 0 < policy.min_num_params <= free and not isinstance(mod, (nn.ModuleList, nn.ModuleDict))
        if by_class or by_size:
            units.append(fqn)
            return 0
        return free

    seen_modules.add(id(model))
    visit(model, "")
    return units


_DP = ("dp_replicate", "dp_shard")


def _axes(mesh: DeviceMesh) -> tuple[int, int, MeshAxes | None]:
    """(replicate, shard) sizes of a mesh with a named ``dp_shard`` axis (and ``dp_replicate``,
    size 1 if absent; any other axes beside them, in any order: `mesh_axes`), or of an unnamed
    1-D / 2-D mesh; the named view, or None for a positional mesh."""
    axes = mesh_axes(mesh, caller="apply_fully_shard")
    if axes.has("dp_shard"):
        return axes.size("dp_replicate"), axes.size("dp_shard"), axes
    if mesh.ndim == 1:
        return 1, mesh.size(0), None
    if mesh.ndim == 2:
        return mesh.size(0), mesh.size(1), None
    raise ValueError(f"apply_fully_shard: got a {mesh.ndim}-D mesh with axes {axes.names or 'unnamed'}; pass a "
                     "1-D or 2-D data-parallel mesh, or a mesh with 'dp_replicate' and 'dp_shard' axes (the mesh of "
                     "shardwise.mesh.init_mesh)")


def _no_shard_mesh(mesh: DeviceMesh, dp: int, axes: MeshAxes | None) -> DeviceMesh:
    """The same data-parallel ranks regrouped as a ``(dp, 1)`` replicate x shard mesh."""
    if mesh.mesh.numel() != dist.get_world_size():
        raise ValueError(
            f"apply_fully_shard(NO_SHARD): the mesh covers {mesh.mesh.numel()} of {dist.get_world_size()} ranks; "
            "NO_SHARD regroups the ranks into a (D, 1) mesh, which every rank must build together. Pass the full "
            "init_mesh(...) mesh, or build the (D, 1) mesh yourself, e.g. "
            "init_device_mesh(device, (D, 1), mesh_dim_names=('dp_replicate', 'dp_shard')).")
    if axes is not None:
        # every data-parallel rank onto the replicate axis, a shard axis of 1, the other axes unchanged
        present = [n for n in axes.names if n in _DP]
        first = min(axes.index(n) for n in present)
        out = [n for n in axes.names[:first] if n not in _DP]
        out += [f"({' '.join(present)}) 1"] + [n for n in axes.names[first:] if n not in _DP]
        ranks = rearrange(mesh.mesh, f"{' '.join(axes.names)} -> {' '.join(out)}")
        names = [n for n in axes.names[:first] if n not in _DP] + list(_DP)
        names += [n for n in axes.names[first:] if n not in _DP]
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=tuple(names))[_DP]
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(dp, 1), mesh_dim_names=_DP)


def strategy_mesh(strategy: ShardingStrategy | str, mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The data-parallel mesh ``fully_shard`` gets for ``strategy``, from ``mesh``.

    ``mesh`` may be any mesh with named ``dp_replicate`` and ``dp_shard`` axes (the 3-D mesh of
    ``shardwise.mesh.init_mesh``, its 4-D one with ``pp``: this rank's stage's), found by name
    whatever their position; an unnamed 1-D shard mesh or 2-D replicate x shard mesh; or None
    (``init_mesh()``: every rank on the shard axis; HYBRID_* need a mesh). With ``R`` replicas
    and ``S`` shards in ``mesh``:

    * FULL_SHARD, SHARD_GRAD_OP: need ``R == 1``; give the 1-D shard mesh.
    * HYBRID_SHARD, HYBRID_SHARD_ZERO2: need ``R > 1``; give the 2-D ``(R, S)`` mesh.
    * NO_SHARD: a ``(R * S, 1)`` mesh over the same ranks: ``mesh`` itself if ``S == 1``,
      otherwise a new mesh, which needs ``mesh`` to span every rank (all ranks build it).

    Raises ValueError naming the mesh and the one to pass instead.
    """
    strategy = ShardingStrategy.parse(strategy)
    if mesh is None and strategy.is_hybrid:
        raise ValueError(f"{strategy.value} needs the replicate x shard split of the ranks: pass "
                         "mesh=shardwise.mesh.init_mesh(dp_replicate=R, dp_shard=S) with R > 1")
    mesh = init_mesh(dp_replicate=1, dp_shard=-1) if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"apply_fully_shard: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    R, S, axes = _axes(mesh)
    if strategy.replicates_all:
        if S == 1 and axes is not None and axes.has("dp_replicate"):
            return axes.sub(*_DP)
        if S == 1 and mesh.ndim == 2:
            return mesh
        return _no_shard_mesh(mesh, R * S, axes)
    problem = strategy.spec.mesh_problem(R, S)  # [Note: the strategy table]
    if problem is not None:
        raise ValueError(problem)
    if strategy.is_hybrid:
        return axes.sub(*_DP) if axes is not None else mesh
    if axes is not None:
        return axes.sub("dp_shard")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    return mesh[names[1]] if names else DeviceMesh.from_group(mesh.get_group(1), mesh.device_type)


def replicate_fits(model: nn.Module, mp: MixedPrecisionPolicy, offload: OffloadPolicy,
                   ignored: list[nn.Parameter]) -> str | None:
    """Why the NO_SHARD strategy cannot use `replicate` for ``model``, or None when it can.

    [Note: NO_SHARD through replicate]
    NO_SHARD keeps a whole copy on every rank; what it needs is DDP's speed. `replicate` keeps
    the parameters plain (DTensor parameters on a (D, 1) mesh made the optimizer step about 1.8x
    slower than DDP's, benchmarks/step.py --phases) and buckets the all-reduces as DDP does. It
    has no casts, offload or ignored parameters and needs materialized plain parameters; else
    NO_SHARD stays `fully_shard` on the ``(D, 1)`` mesh (FSDP2's behaviour there).
    """
    if (mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.buffer_dtype) != (None, None, None, None):
        return "a mixed-precision cast"
    if isinstance(offload, CPUOffloadPolicy):
        return "CPU offload"
    if ignored:
        return "ignored parameters"
    if any(p.is_meta or isinstance(p, DTensor) for p in model.parameters()):
        return "meta-device or DTensor parameters"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fully_shard units inside"
    return None


def apply_fully_shard(model: nn.Module, mesh: DeviceMesh | None = None,
                      policy: ShardingPolicy = ShardingPolicy(), *,
                      ignored_params: Iterable[nn.Parameter] | None = None,
                      mp_policy: MixedPrecisionPolicy | None = None,
                      offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """Shard ``model``: ``fully_shard`` every unit `select_units` picks (children first), then
    the root, on ``strategy_mesh(policy.strategy, mesh)``.

    Units get the strategy's ``reshard_after_forward`` (or the policy's): under FULL_SHARD /
    HYBRID_SHARD ``fully_shard``'s default None, so a pipeline may keep default units gathered
    ([Note: fully_shard units in a pipeline step]); the root gets None, or False under a
    strategy that never reshards. ``ignored_params``, ``mp_policy`` / ``offload_policy``
    (default: the policy's) go to every call. Returns ``model``. Call it on every rank; build
    the optimizer afterwards.
    """
    if not isinstance(policy, ShardingPolicy):
        raise TypeError(f"apply_fully_shard: policy must be a ShardingPolicy, got {type(policy).__name__}")
    dp_mesh = strategy_mesh(policy.strategy, mesh)
    strategy = ShardingStrategy.parse(policy.strategy)
    raf = strategy.reshard_after_forward if policy.reshard_after_forward is None else policy.reshard_after_forward
    ignored = list(ignored_params or ())
    mp = policy.mp_policy if mp_policy is None else mp_policy
    offload = policy.offload_policy if offload_policy is None else offload_policy
    if strategy.replicates_all and replicate_fits(model, mp, offload, ignored) is None:
        return replicate(model, dp_mesh)  # [Note: NO_SHARD through replicate]
    modules = dict(model.named_modules())
    unit_raf = None if raf is True and policy.reshard_after_forward is None else raf  # True is the default
    for name in select_units(model, policy):
        fully_shard(modules[name], mesh=dp_mesh, reshard_after_forward=unit_raf, ignored_params=ignored, mp_policy=mp,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False if raf is False else None, ignored_params=ignored,
                mp_policy=mp, offload_policy=offload)
    return model
