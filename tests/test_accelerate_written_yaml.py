"""YAML files written by Accelerate itself (1.15): its `accelerate config` questionnaire
(`get_cluster_input`, answered by script) builds the `ClusterConfig`, whose `to_yaml_file`
writes the file `from_accelerate_config` then reads; FSDP1 and FSDP2 variants. Accelerate is a
test dependency only (the `test` extra); the library never imports it."""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.model import Llama, LlamaConfig
from shardwise.composable import CPUOffloadPolicy, MixedPrecisionPolicy, ShardingPolicy, from_accelerate_config
from tests._dist import run_ranks

CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=16)
TOKENS = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def accelerate_config_yaml(path: Path, fields: dict[str, str], choices: dict[str, Any]) -> Path:
    """Run Accelerate's own `accelerate config` questions (multi-GPU, FSDP) and write its YAML.

    ``fields``: prompt substring -> typed answer (other prompts: Enter, Accelerate's default);
    ``choices``: prompt substring -> the option picked from a menu (as listed there)."""
    from accelerate.commands.config import cluster

    asked: list[str] = []

    def answer(text: str = "") -> str:
        asked.append(text)
        if len(asked) > 100:  # a prompt Accelerate asks again: the answer was not accepted
            raise AssertionError(f"accelerate config keeps asking: {asked[-1]!r}")
        return next((v for k, v in fields.items() if k in text), "")

    def menu(text: str, options: list = [], convert_value: Callable | None = None, default: int = 0) -> Any:
        asked.append(text)
        pick = next((v for k, v in choices.items() if k in text), default)
        index = options.index(pick) if pick in options else pick
        return convert_value(index) if convert_value is not None else index

    real_input, real_menu = builtins.input, cluster._ask_options
    builtins.input, cluster._ask_options = answer, menu
    try:
        config = cluster.get_cluster_input()
    finally:
        builtins.input, cluster._ask_options = real_input, real_menu
    config.to_yaml_file(str(path))
    return path


def _fsdp(version: int, *, gpus: int = 2, fields: dict | None = None, choices: dict | None = None) -> tuple[dict, dict]:
    return ({"How many GPU(s)": str(gpus), "FullyShardedDataParallel": "yes",
             "layer class names": "TransformerBlock", **(fields or {})},
            {"Which type of machine": "multi-GPU", "FSDP version": version, **(choices or {})})


def test_accelerate_writes_the_keys_this_test_relies_on(tmp_path):
    import yaml

    v2 = yaml.safe_load(accelerate_config_yaml(tmp_path / "2.yaml", *_fsdp(2)).read_text())
    assert v2["fsdp_config"] == {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                                 "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                 "fsdp_transformer_layer_cls_to_wrap": "TransformerBlock",
                                 "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                                 "fsdp_activation_checkpointing": False}, v2  # no fsdp_sync_module_states under 2
    assert v2["num_processes"] == 2 and v2["distributed_type"] == "FSDP", v2
    v1 = yaml.safe_load(accelerate_config_yaml(tmp_path / "1.yaml", *_fsdp(1)).read_text())
    assert v1["fsdp_config"]["fsdp_sync_module_states"] is True and v1["fsdp_config"]["fsdp_version"] == 1, v1


@pytest.mark.parametrize("name,fields,choices,want", [
    ("fsdp2 defaults", {}, {},  # what `accelerate config` writes when every FSDP question gets Enter
     dict(fsdp_version=2, policy=ShardingPolicy(strategy="FULL_SHARD", layer_cls="TransformerBlock"),
          sync_module_states=True, cpu_ram_efficient_loading=True)),
    ("fsdp2 variant", {"resharding after forward": "no", "offload parameters": "yes", "CPU RAM efficient": "no",
                       "activation checkpointing": "yes"},
     {"auto wrap policy": "SIZE_BASED_WRAP", "state dict type": "FULL_STATE_DICT", "mixed precision": "bf16"},
     dict(fsdp_version=2, policy=ShardingPolicy(strategy="SHARD_GRAD_OP", min_num_params=100000000, mp_policy=BF16,
                                                offload_policy=CPUOffloadPolicy()),
          activation_checkpointing=True, state_dict_type="FULL_STATE_DICT")),
    ("fsdp2 no_split_modules", {"_no_split_modules": "yes"}, {"auto wrap policy": "TRANSFORMER_BASED_WRAP"},
     dict(fsdp_version=2, policy=ShardingPolicy(no_split_modules=True), sync_module_states=True,
          cpu_ram_efficient_loading=True)),
    ("fsdp1 defaults", {}, {},
     dict(fsdp_version=1, policy=ShardingPolicy(strategy="FULL_SHARD", layer_cls="TransformerBlock"),
          sync_module_states=True, cpu_ram_efficient_loading=True, state_dict_type="FULL_STATE_DICT")),
    ("fsdp1 variant", {"forward prefetch": "yes", "CPU RAM efficient": "no", "broadcast module parameters": "no"},
     {"sharding strategy": "SHARD_GRAD_OP", "backward prefetch": "NO_PREFETCH",
      "state dict type": "SHARDED_STATE_DICT"},
     dict(fsdp_version=1, policy=ShardingPolicy(strategy="SHARD_GRAD_OP", layer_cls="TransformerBlock"),
          forward_prefetch=True, backward_prefetch="NO_PREFETCH")),
])
def test_reads_the_yaml_accelerate_writes(tmp_path, name, fields, choices, want):
    version = want["fsdp_version"]
    path = accelerate_config_yaml(tmp_path / "fsdp.yaml", *_fsdp(version, fields=fields, choices=choices))
    cfg = from_accelerate_config(path)
    defaults = dict(sync_module_states=False, cpu_ram_efficient_loading=False, activation_checkpointing=False,
                    forward_prefetch=False, backward_prefetch="BACKWARD_PRE", limit_all_gathers=True,
                    state_dict_type="SHARDED_STATE_DICT")
    for key, value in {**defaults, **want}.items():
        assert getattr(cfg, key) == value, (name, key, getattr(cfg, key), value, path.read_text())
    assert cfg.launch["num_processes"] == 2, cfg.launch


@pytest.mark.parametrize("fsdp_config,needle", [
    ({"fsdp_sharding_strategy": "FULL_SHARD"}, "fsdp_sharding_strategy='FULL_SHARD'"),
    ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, "fsdp_reshard_after_forward='SHARD_GRAD_OP'"),
    ({"fsdp_sync_module_states": True, "fsdp_cpu_ram_efficient_loading": False}, "fsdp_sync_module_states=True"),
    ({"fsdp_sync_module_states": False}, "fsdp_sync_module_states=False"),  # cpu-ram loading is on in the file
    ({"fsdp_backward_prefetch": "NO_PREFETCH"}, "fsdp_backward_prefetch='NO_PREFETCH'"),
    ({"fsdp_backward_prefetch": "BACKWARD_POST"}, "fsdp_backward_prefetch='BACKWARD_POST'"),
    ({"fsdp_forward_prefetch": True}, "fsdp_forward_prefetch=True"),
    ({"fsdp_use_orig_params": False}, "fsdp_use_orig_params=False"),
    ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type='LOCAL_STATE_DICT'"),
    ({"fsdp_activation_checkpointing_offload": True}, "fsdp_activation_checkpointing_offload=True"),
], ids=lambda v: None if isinstance(v, dict) else v[:40])
def test_fsdp1_keys_accelerate_drops_or_refuses_under_fsdp2_are_refused_by_name(tmp_path, fsdp_config, needle):
    import yaml

    path = accelerate_config_yaml(tmp_path / "fsdp.yaml", *_fsdp(2))
    data = yaml.safe_load(path.read_text())
    data["fsdp_config"].update(fsdp_config)
    with pytest.raises(ValueError) as e:
        from_accelerate_config(data)
    assert needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value), str(e.value)


def test_fsdp2_accepts_the_obsolete_keys_with_the_value_that_happens_anyway(tmp_path):
    import yaml

    data = yaml.safe_load(accelerate_config_yaml(tmp_path / "fsdp.yaml", *_fsdp(2)).read_text())
    data["fsdp_config"].update(fsdp_sync_module_states=True, fsdp_use_orig_params=True,
                               fsdp_backward_prefetch="BACKWARD_PRE", fsdp_forward_prefetch=False,
                               fsdp_activation_checkpointing_offload=False, fsdp_reshard_after_forward="false")
    cfg = from_accelerate_config(data)
    assert (cfg.sync_module_states, cfg.forward_prefetch, cfg.backward_prefetch) == (True, False, "BACKWARD_PRE"), cfg
    assert cfg.policy.strategy.value == "SHARD_GRAD_OP", cfg.policy


# -- on real ranks: rank-0 load + broadcast, the launcher's world size -----------------------------
def _llama(seed: int) -> Llama:
    return Llama(CFG, generator=torch.Generator().manual_seed(seed))


def _fsdp2_yaml_on_ranks(rank: int, world_size: int, broadcast: str, local: str) -> dict:
    from shardwise.mesh import init_mesh

    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = from_accelerate_config(broadcast)   # fsdp_cpu_ram_efficient_loading: true, num_processes: 3
        if rank == 0:
            model = _llama(0)                       # only rank 0 loads the weights
        else:
            with torch.device("meta"):
                model = Llama(CFG)
        cfg.apply(model, init_mesh())
        cfg.apply(_llama(0) if rank == 0 else _llama(5), init_mesh())  # a second apply warns no more
    out["warned"] = [str(w.message) for w in caught if "num_processes" in str(w.message)]
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    logits = model(TOKENS[rank * 2: rank * 2 + 2])
    logits.square().mean().backward()
    out["logits"] = logits.detach()
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # cpu-ram-efficient loading off: no broadcast under FSDP2 (Accelerate's meaning), each rank keeps its own
    plain = from_accelerate_config(local).apply(_llama(rank), init_mesh())
    out["plain"] = {n: p.full_tensor() for n, p in plain.named_parameters()}
    return out


def test_fsdp2_yaml_loads_on_rank0_broadcasts_and_trains_like_one_process(tmp_path):
    broadcast = accelerate_config_yaml(tmp_path / "broadcast.yaml", *_fsdp(2, gpus=3))
    local = accelerate_config_yaml(tmp_path / "local.yaml", *_fsdp(2, fields={"CPU RAM efficient": "no"}))
    assert "fsdp_sync_module_states" not in broadcast.read_text(), broadcast.read_text()
    want = _llama(0)
    logits = want(TOKENS)
    logits.square().mean().backward()
    results = run_ranks(_fsdp2_yaml_on_ranks, 2, str(broadcast), str(local), timeout=120)
    for rank, out in enumerate(results):
        for n, p in want.named_parameters():
            assert torch.equal(out["params"][n], p.detach()), (rank, n, "rank 0's weights, broadcast")
            torch.testing.assert_close(out["grads"][n], p.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{rank} {n} {m}")
        torch.testing.assert_close(out["logits"], logits.detach()[rank * 2: rank * 2 + 2], rtol=1e-6, atol=1e-6)
        if rank == 0:
            assert len(out["warned"]) == 1, ("rank 0 warns once", out["warned"])
            assert "num_processes=3" in out["warned"][0] and "2 ranks" in out["warned"][0], out["warned"]
        else:
            assert out["warned"] == [], (rank, "only rank 0 warns", out["warned"])
        assert not all(torch.equal(out["plain"][n], p.detach()) for n, p in want.named_parameters()), \
            (rank, "without cpu-ram-efficient loading nothing is broadcast: rank 1's half is its own init")


def _fsdp2_on_a_replicated_mesh(rank: int, world_size: int) -> dict:
    from shardwise.mesh import init_mesh

    mesh = init_mesh(dp_replicate=2, dp_shard=2)
    out: dict[str, Any] = {}
    for name, raf in (("zero3", True), ("zero2", False)):
        model = from_accelerate_config({"fsdp_version": 2, "fsdp_reshard_after_forward": raf}).apply(_llama(0), mesh)
        w = model.output.weight
        out[name] = (tuple(type(p).__name__ for p in w.placements), w.device_mesh.ndim)
    try:
        from_accelerate_config({"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD"}).apply(_llama(0), mesh)
        out["fsdp1"] = "not refused"
    except ValueError as e:
        out["fsdp1"] = str(e)
    return out


def test_fsdp2_takes_hybrid_sharding_from_the_mesh():
    """Under FSDP2 a bool cannot name HYBRID_SHARD (Accelerate gets it from parallelism_config):
    `apply` on a mesh with replicas shards within them; FSDP1's FULL_SHARD on it is refused."""
    for rank, out in enumerate(run_ranks(_fsdp2_on_a_replicated_mesh, 4, timeout=120)):
        assert out["zero3"] == out["zero2"] == (("Replicate", "Shard"), 2), (rank, "HSDP on the 2 x 2 mesh", out)
        assert "HYBRID_SHARD" in out["fsdp1"], (rank, out["fsdp1"])
