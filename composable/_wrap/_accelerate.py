"""Accelerate's FSDP configuration, read whole: every key takes effect or is refused.

    from shardwise.composable import from_accelerate_config

    cfg = from_accelerate_config("fsdp.yaml")      # the file `accelerate config` wrote, or a dict
    cfg.apply(model, mesh)                          # units, strategy, mixed precision, offload,
                                                    # prefetch, activation checkpointing, rank-0 sync
    get_model_state_dict(model, options=cfg.state_dict_options)

[Note: no key is ignored]
`from_accelerate_config` sorts every key of the YAML (top level and ``fsdp_config``, with or
without the ``fsdp_`` prefix) into one of: a setting of `ShardingPolicy` (strategy, units,
``reshard_after_forward``, mixed precision, offload); a step of `AccelerateConfig.apply`
(rank-0 sync, activation checkpointing, prefetch, the all-gather limit); a state-dict choice
(`AccelerateConfig.state_dict_options`); a launcher setting (``num_processes`` ...: kept in
``launch``, and the world size is checked against it in ``apply``); or a refusal, a
``ValueError`` naming the key, its value and what to do. A key that is none of these (a typo,
a newer Accelerate key) is refused too. docs/accelerate.md has the table.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._fsdp import broadcast_from_rank0
from .._fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._policy import ShardingPolicy, apply_fully_shard, select_units

__all__ = ["AccelerateConfig", "from_accelerate_config"]

# top-level keys only `accelerate launch` reads (torchrun's job here); kept in AccelerateConfig.launch
_LAUNCH = {"num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
           "same_network", "main_training_function", "gpu_ids", "enable_cpu_affinity", "use_cpu"}
# top-level keys for other backends: accepted only when empty / off
_OFF = {"tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "tpu_name": None, "tpu_zone": None,
        "commands": None, "command_file": None, "deepspeed_config": {}, "megatron_lm_config": {}, "fp8_config": {},
        "ipex_config": {}, "mpirun_config": {}, "parallelism_config": {}, "debug": False, "downcast_bf16": "no"}
_PREFETCH = {"BACKWARD_PRE", "NO_PREFETCH"}


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none", ""):
        return False
    raise ValueError(f"Accelerate config: {key}={value!r} is not a boolean; use true or false")


def _refuse(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"Accelerate config: {key}={value!r} is not supported: {why}")


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
    sync_module_states: bool = False
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False
    forward_prefetch: bool = False
    backward_prefetch: str = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"
    launch: dict = field(default_factory=dict)

    def policy_only(self) -> ShardingPolicy:
        """``policy``, refusing settings that only `apply` carries out."""
        asked = {k: getattr(self, k) for k, default in (
            ("sync_module_states", False), ("cpu_ram_efficient_loading", False), ("activation_checkpointing", False),
            ("forward_prefetch", False), ("backward_prefetch", "BACKWARD_PRE"), ("limit_all_gathers", True),
            ("state_dict_type", "SHARDED_STATE_DICT")) if getattr(self, k) != default}
        if asked:
            raise ValueError(f"ShardingPolicy.from_accelerate: {asked} are not sharding-policy settings and would be "
                             "lost here; use shardwise.composable.from_accelerate_config(config).apply(model, mesh) "
                             "(and its .state_dict_options), which carries them out")
        return self.policy

    @property
    def state_dict_options(self):
        """``StateDictOptions`` for ``fsdp_state_dict_type``: sharded (the default), or
        ``FULL_STATE_DICT``: full tensors gathered to CPU on rank 0, as Accelerate does."""
        from shardwise.checkpoint import StateDictOptions

        full = self.state_dict_type == "FULL_STATE_DICT"
        return StateDictOptions(full_state_dict=full, cpu_offload=full)

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None, *,
              ignored_params: Iterable[nn.Parameter] | None = None) -> nn.Module:
        """Shard ``model`` as the config says; collective. In order: checks the world size
        against ``num_processes``; keeps rank 0's full state dict (``sync_module_states``;
        with ``cpu_ram_efficient_loading`` the other ranks may build the model on the meta
        device); wraps each unit's forward in non-reentrant ``torch.utils.checkpoint``
        (``activation_checkpointing``); `apply_fully_shard` with ``policy``; sets explicit
        forward prefetch in module order (``forward_prefetch``), no backward prefetch
        (``NO_PREFETCH``), no all-gather limit (``limit_all_gathers: false``); then
        ``broadcast_from_rank0``. Returns ``model``."""
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
        apply_fully_shard(model, mesh, self.policy, ignored_params=ignored_params)
        units = [model] + [modules[n] for n in names]
        if self.forward_prefetch:  # from the first step on, in module order (the root runs first)
            for unit, nxt in zip(units, units[1:]):
                unit.set_modules_to_forward_prefetch([nxt])
        if self.backward_prefetch == "NO_PREFETCH":
            for unit in units:
                unit.set_modules_to_backward_prefetch([])
        if not self.limit_all_gathers:
            model.set_unshard_limit(len(units) + 1)  # type: ignore[operator]  # an FSDPModule now
        if self.sync_module_states:
            broadcast_from_rank0(model, full)
        return model

    def _check_world(self) -> None:
        n = self.launch.get("num_processes")
        if n is None or not dist.is_initialized():
            return
        world = dist.get_world_size()
        if int(n) != world:
            raise ValueError(f"Accelerate config: num_processes={n} (the total over all machines, as Accelerate "
                             f"counts it) but the job has {world} ranks; launch with torchrun --nproc-per-node "
                             f"{int(n) // int(self.launch.get('num_machines', 1))} --nnodes "
                             f"{self.launch.get('num_machines', 1)}, or fix num_processes")


def _checkpoint_forward(module: nn.Module) -> None:
    """Run ``module``'s forward under non-reentrant activation checkpointing (recomputed in
    backward, RNG state preserved so dropout repeats its mask)."""
    inner = module.forward

    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def _read_yaml(path: str) -> dict:
    try:
        import yaml
    except ImportError:  # a dependency (pyproject.toml); only a broken install lacks it
        raise ImportError("reading an Accelerate YAML file needs pyyaml: pip install pyyaml") from None
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an Accelerate config (a YAML mapping), got {type(data).__name__}")
    return data


def _mixed_precision(value: Any) -> MixedPrecisionPolicy:
    text = "no" if value is False or value is None else str(value).strip().lower()
    if text == "no":
        return MixedPrecisionPolicy()
    if text == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if text == "fp16":
        raise _refuse("mixed_precision", value, "fp16 needs loss scaling, which shardwise does not provide; use bf16, "
                      "or pass MixedPrecisionPolicy(param_dtype=torch.float16) yourself with your own loss scaler")
    raise _refuse("mixed_precision", value, "use 'no' or 'bf16' (fp8 is not offered)")


def _fsdp(cfg: dict, mp: MixedPrecisionPolicy, launch: dict) -> AccelerateConfig:
    c = {k[5:] if k.startswith("fsdp_") else k: v for k, v in cfg.items()}
    out: dict[str, Any] = {"launch": launch}
    version = int(c.pop("version", 1))
    if version not in (1, 2):
        raise _refuse("fsdp_version", version, "use 1 or 2 (both map onto fully_shard)")
    strategy = str(c.pop("sharding_strategy", "FULL_SHARD"))
    raf = c.pop("reshard_after_forward", None)
    if raf is not None:
        flag = str(raf).strip().lower()
        if flag in ("true", "false"):
            hybrid = strategy.upper().rpartition(".")[2].startswith("HYBRID") or strategy in ("4", "5")
            strategy = {("true", False): "FULL_SHARD", ("false", False): "SHARD_GRAD_OP",
                        ("true", True): "HYBRID_SHARD", ("false", True): "HYBRID_SHARD_ZERO2"}[flag, hybrid]
        else:
            strategy = str(raf)
    wrap = str(c.pop("auto_wrap_policy", "NO_WRAP") or "NO_WRAP").upper()
    layers = c.pop("transformer_layer_cls_to_wrap", None) or ()
    min_params = int(c.pop("min_num_params", 0) or 0)
    units: dict[str, Any]
    if wrap == "TRANSFORMER_BASED_WRAP":
        units = dict(layer_cls=layers, no_split_modules=not layers)
    elif wrap == "SIZE_BASED_WRAP":
        if min_params <= 0:
            raise _refuse("fsdp_min_num_params", min_params, "SIZE_BASED_WRAP needs fsdp_min_num_params > 0")
        units = dict(min_num_params=min_params)
    elif wrap == "NO_WRAP":
        units = {}
    else:
        raise _refuse("fsdp_auto_wrap_policy", wrap, "use TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")
    if layers and wrap != "TRANSFORMER_BASED_WRAP":
        raise _refuse("fsdp_transformer_layer_cls_to_wrap", layers, f"it needs TRANSFORMER_BASED_WRAP, not {wrap}")
    if min_params and wrap != "SIZE_BASED_WRAP":
        raise _refuse("fsdp_min_num_params", min_params, f"it needs SIZE_BASED_WRAP, not {wrap}")
    offload = _bool("fsdp_offload_params", c.pop("offload_params", False))
    pin = c.pop("cpu_offload_pin_memory", None)
    if pin is not None and not offload:
        raise _refuse("fsdp_cpu_offload_pin_memory", pin, "it applies only with fsdp_offload_params: true")
    pin = None if pin is None else _bool("fsdp_cpu_offload_pin_memory", pin)
    policy = ShardingPolicy(strategy=strategy, mp_policy=mp, **units,
                            offload_policy=CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy())
    out["policy"] = policy
    prefetch = c.pop("backward_prefetch", c.pop("backward_prefetch_policy", "BACKWARD_PRE")) or "BACKWARD_PRE"
    prefetch = str(prefetch).upper().rpartition(".")[2]
    if prefetch not in _PREFETCH:
        raise _refuse("fsdp_backward_prefetch", prefetch, "FSDP1's BACKWARD_POST has no counterpart here; use "
                      "BACKWARD_PRE (the default: the next unit's all-gather is issued before this unit's backward) "
                      "or NO_PREFETCH")
    out["backward_prefetch"] = prefetch
    for key in ("forward_prefetch", "sync_module_states", "cpu_ram_efficient_loading", "activation_checkpointing",
                "limit_all_gathers"):
        if key in c:
            out[key] = _bool(f"fsdp_{key}", c.pop(key))
    if out.get("cpu_ram_efficient_loading") and not out.get("sync_module_states"):
        raise _refuse("fsdp_cpu_ram_efficient_loading", True, "the other ranks would keep empty weights; set "
                      "fsdp_sync_module_states: true as well (Accelerate requires it too)")
    sd_type = str(c.pop("state_dict_type", "SHARDED_STATE_DICT") or "SHARDED_STATE_DICT").upper().rpartition(".")[2]
    if sd_type not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        raise _refuse("fsdp_state_dict_type", sd_type, "FSDP1's flat LOCAL_STATE_DICT has no counterpart; use "
                      "SHARDED_STATE_DICT (reshardable) or FULL_STATE_DICT")
    out["state_dict_type"] = sd_type
    if not _bool("fsdp_use_orig_params", c.pop("use_orig_params", True)):
        raise _refuse("fsdp_use_orig_params", False, "shardwise always keeps the original parameters (FSDP2's "
                      "behaviour); set it to true or remove it")
    if c:
        key = sorted(c)[0]
        raise _refuse(f"fsdp_{key}", c[key], f"unknown FSDP key (known: see docs/accelerate.md); remove it. All "
                      f"unknown: {sorted('fsdp_' + k for k in c)}")
    return AccelerateConfig(**out)


def from_accelerate_config(source: str | os.PathLike | dict) -> AccelerateConfig:
    """Read an Accelerate config: the YAML file ``accelerate config`` writes (a path), the
    same as a dict, or just its ``fsdp_config`` mapping. Raises ``ValueError`` naming the first
    key that cannot take effect (see [Note: no key is ignored])."""
    data = _read_yaml(os.fspath(source)) if not isinstance(source, dict) else dict(source)
    if "fsdp_config" not in data and "distributed_type" not in data:  # the fsdp_config mapping (+ top keys)
        top = {"mixed_precision", "compute_environment", "dynamo_config", *_LAUNCH, *_OFF}
        data = {"distributed_type": "FSDP", "fsdp_config": {k: v for k, v in data.items() if k not in top},
                **{k: v for k, v in data.items() if k in top}}
    kind = str(data.pop("distributed_type", "FSDP")).upper().rpartition(".")[2]
    if kind != "FSDP":
        raise _refuse("distributed_type", kind, "shardwise reads FSDP configs; run `accelerate config` and choose FSDP")
    env = str(data.pop("compute_environment", "LOCAL_MACHINE")).upper()
    if env != "LOCAL_MACHINE":
        raise _refuse("compute_environment", env, "only LOCAL_MACHINE (launch with torchrun) is supported")
    mp = _mixed_precision(data.pop("mixed_precision", "no"))
    launch = {k: data.pop(k) for k in list(data) if k in _LAUNCH}
    for key, off in _OFF.items():
        if key in data:
            value = data.pop(key)
            if value not in (off, None, "", [], {}, False) and str(value).lower() not in ("no", "false"):
                raise _refuse(key, value, f"that is for another backend or tool; set it to {off!r} or remove it")
    dynamo = data.pop("dynamo_config", None) or {}
    if dynamo and str(dynamo.get("dynamo_backend", "NO")).upper() != "NO":
        raise _refuse("dynamo_config", dynamo, "torch.compile is not applied by this config; call torch.compile "
                      "yourself and remove dynamo_config")
    fsdp = data.pop("fsdp_config", None) or {}
    if data:
        raise _refuse(sorted(data)[0], data[sorted(data)[0]], f"unknown Accelerate key; remove it. All unknown: "
                      f"{sorted(data)}")
    return _fsdp(fsdp, mp, launch)

