"""`AccelerateConfig`: what an Accelerate FSDP config asks for (`from_accelerate_config`), and
`AccelerateConfig.apply`, which carries it out on a model (units, strategy, mixed precision,
offload, prefetch, activation checkpointing, rank-0 sync). Reading the YAML is
``_accelerate.py``'s ([Note: no key is ignored] there)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.checkpoint import scatter_full

from .._fsdp import FSDPModule, broadcast_state
from ._accelerate import read_accelerate_config
from ._policy import ShardingPolicy, _axes, apply_fully_shard, select_units
from ._strategies import ShardingStrategy

__all__ = ["AccelerateConfig", "broadcast_from_rank0", "from_accelerate_config"]


@dataclass(frozen=True)
class AccelerateConfig:
    """Everything an Accelerate FSDP config asks for (see [Note: no key is ignored]).

    ``policy``: the `ShardingPolicy` (strategy, units, mixed precision, offload). The other
    fields are applied by `apply` (``sync_module_states``, ``cpu_ram_efficient_loading``,
    ``activation_checkpointing``, ``forward_prefetch``, ``backward_prefetch``,
    ``limit_all_gathers``) or by `state_dict_options` (``state_dict_type``). ``launch``: the
    launcher's keys, as given.
    """

    policy: ShardingPolicy = ShardingPolicy()
    fsdp_version: int = 1
    sync_module_states: bool = False
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"
    launch: dict = field(default_factory=dict)

    @property
    def state_dict_options(self):
        """``StateDictOptions`` for ``fsdp_state_dict_type``: sharded (the default), or
        ``FULL_STATE_DICT``: full tensors gathered to CPU on rank 0, as Accelerate does."""
        from shardwise.checkpoint import StateDictOptions

        full = self.state_dict_type == "FULL_STATE_DICT"
        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None, *,
              ignored_params: Iterable[nn.Parameter] | None = None) -> nn.Module:
        """Shard ``model`` as the config says; collective. In order: compares the world size
        with ``num_processes`` (the launcher's world is used; rank 0 warns once if they
        differ); keeps rank 0's full state dict (``sync_module_states``; with
        ``cpu_ram_efficient_loading`` the other ranks may build the model on the meta device);
        wraps each unit's forward in non-reentrant ``torch.utils.checkpoint``
        (``activation_checkpointing``); `apply_fully_shard` with ``policy`` (under FSDP2 its
        hybrid counterpart on a mesh with replicas); sets explicit forward prefetch in module
        order (``forward_prefetch``), no backward prefetch (``NO_PREFETCH``), no all-gather
        limit (``limit_all_gathers: false``); then ``broadcast_from_rank0``. Returns ``model``."""
        self._check_world()
        full = None
        if self.sync_module_states:
            problem = None
            if dist.get_rank() == 0:
                full = dict(model.state_dict())
                if any(v.device.type == "meta" for v in full.values()):
                    problem = ("Accelerate config: fsdp_sync_module_states broadcasts rank 0's weights, but rank 0's "
                               "model is on the meta device; build (or load) it for real on rank 0")
            problems = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)  # every rank raises, none waits in a broadcast
            if problems[0]:
                raise ValueError(problems[0])
        names = select_units(model, self.policy)
        modules = dict(model.named_modules())
        if self.activation_checkpointing:
            if not names:
                raise ValueError("Accelerate config: fsdp_activation_checkpointing checkpoints each wrapped block, but "
                                 "the policy selects none (NO_WRAP); name fsdp_transformer_layer_cls_to_wrap")
            for n in names:
                _checkpoint_forward(modules[n])
        apply_fully_shard(model, mesh, self._policy_for(mesh), ignored_params=ignored_params)
        if not isinstance(model, FSDPModule):  # NO_SHARD through replicate: whole parameters, already
            return model                       # broadcast from rank 0; no units to tune
        units = [model] + [modules[n] for n in names]
        if self.forward_prefetch:  # from the first step on, in module order (the root runs first)
            for unit, nxt in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([nxt])
        if self.backward_prefetch == "NO_PREFETCH":
            for unit in units:
                unit.set_modules_to_backward_prefetch([])
        if not self.limit_all_gathers:
            model.set_unshard_limit(len(units) + 1)  # an FSDPModule (checked above)
        if self.sync_module_states:
            broadcast_state(model, full, 0, scatter_full)
        return model

    def _policy_for(self, mesh: DeviceMesh | None) -> ShardingPolicy:
        """Under FSDP2 the mesh decides hybrid sharding (Accelerate takes it from
        ``parallelism_config``; here from the mesh given to `apply`): a mesh with replicas turns
        FULL_SHARD / SHARD_GRAD_OP into HYBRID_SHARD / HYBRID_SHARD_ZERO2."""
        if self.fsdp_version != 2 or not isinstance(mesh, DeviceMesh) or _axes(mesh)[0] == 1:
            return self.policy
        hybrid = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "HYBRID_SHARD_ZERO2"}
        name = ShardingStrategy.parse(self.policy.strategy).value
        return replace(self.policy, strategy=hybrid.get(name, name))

    def _check_world(self) -> None:
        """The launcher's world size wins over ``num_processes`` (a job resumed at another
        size runs with the same file); rank 0 warns once per process when they differ."""
        n = self.launch.get("num_processes")
        if n is None or not dist.is_initialized():
            return
        n, world = int(n), dist.get_world_size()
        if n > 0 and n != world and dist.get_rank() == 0 and (n, world) not in _WORLD_WARNED:
            _WORLD_WARNED.add((n, world))
            warnings.warn(f"Accelerate config: num_processes={n} but the launcher started {world} ranks; training "
                          f"on {world} (the launcher decides; set num_processes: {world} to silence this)",
                          UserWarning, stacklevel=3)


_WORLD_WARNED: set[tuple[int, int]] = set()  # (num_processes, world size) pairs rank 0 has warned about


def _checkpoint_forward(module: nn.Module) -> None:
    """Run ``module``'s forward under non-reentrant activation checkpointing (recomputed in
    backward, RNG state preserved so dropout repeats its mask)."""
    inner = module.forward

    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def from_accelerate_config(source: str | os.PathLike | dict) -> AccelerateConfig:
    """Read an Accelerate config: the YAML file ``accelerate config`` writes (a path), the
    same as a dict, or just its ``fsdp_config`` mapping. Raises ``ValueError`` naming the first
    key that cannot take effect (see [Note: no key is ignored] in ``_accelerate.py``)."""
    fields = read_accelerate_config(source)
    return AccelerateConfig(**{**fields, "policy": ShardingPolicy(**fields["policy"])})


def broadcast_from_rank0(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None,
                         src_rank: int = 0) -> None:
    """Fill a sharded model from a full state dict that only rank ``src_rank`` holds (others
    pass None and may have built the model on the meta device): Accelerate's
    ``sync_module_states`` / ``cpu_ram_efficient_loading``. One tensor at a time goes through
    ``shardwise.checkpoint.scatter_full``, so no rank holds more than its shards and one full
    tensor; buffers come from the source rank's model. Collective: call it on every rank. On the
    source rank, take ``model.state_dict()`` before ``fully_shard``. A state dict it cannot use
    raises the same error on every rank (KeyError / ValueError) before anything is sent.
    """
    broadcast_state(model, full_state_dict, src_rank, scatter_full)
