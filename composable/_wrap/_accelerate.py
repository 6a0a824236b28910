"""Accelerate's FSDP configuration, read whole: every key takes effect or is refused.

    from shardwise.composable import from_accelerate_config

    cfg = from_accelerate_config("fsdp.yaml")      # the file `accelerate config` wrote, or a dict
    cfg.apply(model, mesh)                          # units, strategy, mixed precision, offload,
                                                    # prefetch, activation checkpointing, rank-0 sync
    get_model_state_dict(model, options=cfg.state_dict_options)

[Note: no key is ignored]
Every key of the YAML (top level and ``fsdp_config``, with or without ``fsdp_``) is sorted into:
a `ShardingPolicy` setting; a step of `AccelerateConfig.apply` (rank-0 sync, activation
checkpointing, prefetch, the all-gather limit); a state-dict choice; a launcher setting (kept in
``launch``; ``apply`` warns once if ``num_processes`` differs from the world); or a refusal, a
``ValueError`` naming the key, its value and what to do (also for unknown keys). Keys have
Accelerate 1.15's meaning for the file's ``fsdp_version`` (docs/accelerate.md has the table).
`read_accelerate_config` returns the sorted fields; the config object is ``_accelerate_config.py``,
`ShardingPolicy.from_accelerate` is ``_policy.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["APPLY_DEFAULTS", "read_accelerate_config"]

#: `AccelerateConfig.apply` / ``state_dict_options`` settings and their defaults (what
#: `ShardingPolicy.from_accelerate` refuses to drop when a config asks for another value)
APPLY_DEFAULTS = {"sync_module_states": False, "cpu_ram_efficient_loading": False, "activation_checkpointing": False,
                  "forward_prefetch": False, "backward_prefetch": "BACKWARD_PRE", "limit_all_gathers": True,
                  "state_dict_type": "SHARDED_STATE_DICT"}

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


def _flag(key: str, value: Any) -> bool | None:
    """``value`` as a bool when it is one (a YAML bool or its spelling), else None."""
    try:
        return _bool(key, value)
    except ValueError:
        return None


def _fsdp1_strategy(c: dict) -> str:
    """FSDP1: ``sharding_strategy``, or ``reshard_after_forward`` as a strategy name (what
    ``accelerate config`` writes for FSDP1) or a bool (with the hybrid-ness of the strategy)."""
    strategy = str(c.pop("sharding_strategy", "FULL_SHARD"))
    raf = c.pop("reshard_after_forward", None)
    if raf is None:
        return strategy
    flag = str(raf).strip().lower()
    if flag not in ("true", "false"):
        return str(raf)
    hybrid = strategy.upper().rpartition(".")[2].startswith("HYBRID") or strategy in ("4", "5")
    return {("true", False): "FULL_SHARD", ("false", False): "SHARD_GRAD_OP",
            ("true", True): "HYBRID_SHARD", ("false", True): "HYBRID_SHARD_ZERO2"}[flag, hybrid]


def _fsdp2_strategy(c: dict) -> str:
    """FSDP2 (Accelerate 1.15): ``reshard_after_forward`` is a bool, default true;
    ``sharding_strategy`` is not read (Accelerate's launcher drops it under version 2)."""
    if "sharding_strategy" in c:
        raise _refuse("fsdp_sharding_strategy", c["sharding_strategy"], "Accelerate does not read it under "
                      "fsdp_version: 2; use fsdp_reshard_after_forward: true (FULL_SHARD) or false (SHARD_GRAD_OP) "
                      "instead (`accelerate to-fsdp2` converts the file)")
    raf = c.pop("reshard_after_forward", True)
    flag = _flag("fsdp_reshard_after_forward", raf)
    if flag is None:
        raise _refuse("fsdp_reshard_after_forward", raf, "under fsdp_version: 2 it is a bool, as Accelerate requires: "
                      "true (FULL_SHARD) or false (SHARD_GRAD_OP)")
    return "FULL_SHARD" if flag else "SHARD_GRAD_OP"


def _prefetch_name(value: Any) -> str:
    return str(value or "BACKWARD_PRE").upper().rpartition(".")[2]


def _fsdp1_prefetch_and_sync(c: dict, out: dict[str, Any]) -> None:
    """FSDP1: backward / forward prefetch as set; ``sync_module_states`` as set, implied by
    ``cpu_ram_efficient_loading`` when absent (Accelerate's launcher and plugin both do so)."""
    prefetch = _prefetch_name(c.pop("backward_prefetch", c.pop("backward_prefetch_policy", "BACKWARD_PRE")))
    if prefetch not in _PREFETCH:
        raise _refuse("fsdp_backward_prefetch", prefetch, "FSDP1's BACKWARD_POST has no counterpart here; use "
                      "BACKWARD_PRE (the default: the next unit's all-gather is issued before this unit's backward) "
                      "or NO_PREFETCH")
    out["backward_prefetch"] = prefetch
    for key in ("forward_prefetch", "sync_module_states", "cpu_ram_efficient_loading"):
        if key in c:
            out[key] = _bool(f"fsdp_{key}", c.pop(key))
    if out.get("cpu_ram_efficient_loading"):
        if out.setdefault("sync_module_states", True) is False:
            raise _refuse("fsdp_sync_module_states", False, "with fsdp_cpu_ram_efficient_loading: true the other "
                          "ranks hold empty weights until rank 0's are broadcast; set fsdp_sync_module_states: true "
                          "or remove it (Accelerate's launcher refuses this pair too)")


def _fsdp2_obsolete(c: dict, out: dict[str, Any]) -> None:
    """FSDP2 (Accelerate 1.15): ``cpu_ram_efficient_loading`` means rank 0 loads and
    broadcasts; the FSDP1 keys Accelerate drops or refuses under version 2 are accepted only
    with the value that is what happens anyway, refused otherwise (see docs/accelerate.md)."""
    cpu_ram = _bool("fsdp_cpu_ram_efficient_loading", c.pop("cpu_ram_efficient_loading", False))
    out["cpu_ram_efficient_loading"] = out["sync_module_states"] = cpu_ram
    if "sync_module_states" in c:
        sync = _bool("fsdp_sync_module_states", c.pop("sync_module_states"))
        if sync != cpu_ram:
            raise _refuse("fsdp_sync_module_states", sync, "obsolete under fsdp_version: 2 (Accelerate drops it): "
                          "rank 0's weights are broadcast exactly when fsdp_cpu_ram_efficient_loading is true; "
                          "remove fsdp_sync_module_states")
    for key in ("backward_prefetch", "backward_prefetch_policy"):
        if key in c:
            value = c.pop(key)
            if _prefetch_name(value) != "BACKWARD_PRE":
                raise _refuse(f"fsdp_{key}", value, "under fsdp_version: 2 Accelerate drops it and each unit's "
                              "backward prefetches the next one's all-gather whatever it says; remove it (or use "
                              "fsdp_version: 1, where NO_PREFETCH turns prefetching off)")
    if _bool("fsdp_forward_prefetch", c.pop("forward_prefetch", False)):
        raise _refuse("fsdp_forward_prefetch", True, "Accelerate's FSDP plugin refuses it under fsdp_version: 2 "
                      "(not implemented for FSDP2); remove it, or use fsdp_version: 1 for explicit forward prefetch")


def _fsdp(cfg: dict, mp: MixedPrecisionPolicy, launch: dict) -> dict[str, Any]:
    c = {k[5:] if k.startswith("fsdp_") else k: v for k, v in cfg.items()}
    out: dict[str, Any] = {"launch": launch}
    raw_version = c.pop("version", 1)
    try:
        version = int(raw_version)
    except (TypeError, ValueError):
        version = -1
    if version not in (1, 2):
        raise _refuse("fsdp_version", raw_version, "use 1 or 2 (both map onto fully_shard)")
    out["fsdp_version"] = version
    strategy = _fsdp2_strategy(c) if version == 2 else _fsdp1_strategy(c)
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
    out["policy"] = dict(strategy=strategy, mp_policy=mp, **units,
                         offload_policy=CPUOffloadPolicy(pin_memory=pin) if offload else OffloadPolicy())
    if version == 2:
        _fsdp2_obsolete(c, out)
    else:
        _fsdp1_prefetch_and_sync(c, out)
    if "activation_checkpointing" in c:
        out["activation_checkpointing"] = _bool("fsdp_activation_checkpointing", c.pop("activation_checkpointing"))
    if "limit_all_gathers" in c:
        out["limit_all_gathers"] = _bool("fsdp_limit_all_gathers", c.pop("limit_all_gathers"))
    if _bool("fsdp_activation_checkpointing_offload", c.pop("activation_checkpointing_offload", False)):
        raise _refuse("fsdp_activation_checkpointing_offload", True, "offloading checkpointed inputs to CPU is not "
                      "offered (checkpointed blocks keep their inputs where they are); set it to false or remove it")
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
    return out


def read_accelerate_config(source: str | os.PathLike | dict) -> dict[str, Any]:
    """The fields of `AccelerateConfig` from an Accelerate config (see `from_accelerate_config`),
    ``policy`` as `ShardingPolicy`'s keyword arguments. Raises ``ValueError`` naming the first
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
    if "num_processes" in launch:
        n = launch["num_processes"]
        if isinstance(n, bool) or not isinstance(n, (int, str)) or not str(n).strip().lstrip("-").isdigit():
            raise _refuse("num_processes", n, "it is the total number of ranks, an integer; fix it or remove it")
    for key, off in _OFF.items():
        if key in data:
            value = data.pop(key)
            if value not in (off, None, "", [], {}, False) and str(value).lower() not in ("no", "false"):
                if key == "parallelism_config":
                    raise _refuse(key, value, "shardwise takes the data-parallel layout from the mesh: remove it and "
                                  "pass shardwise.mesh.init_mesh(dp_replicate=R, dp_shard=S) to apply")
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

