"""Accelerate FSDP configs: every key takes effect (checked on real ranks) or is refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from examples.model import Llama, LlamaConfig
from shardwise.composable import (
    AccelerateConfig,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingPolicy,
    apply_fully_shard,
    from_accelerate_config,
    fully_shard,
)
from tests._dist import run_ranks

# the YAML of the Accelerate FSDP guide (/work/shared/seeds/accelerate-fsdp-guide.txt), verbatim
GUIDE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=16)
TOKENS = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))


def test_reads_the_yaml_accelerate_config_writes_in_one_call(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(GUIDE_YAML)
    cfg = from_accelerate_config(tmp_path / "fsdp.yaml")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert cfg == AccelerateConfig(
        policy=ShardingPolicy(strategy="FULL_SHARD", layer_cls="BertLayer", mp_policy=bf16),
        sync_module_states=True, cpu_ram_efficient_loading=True, forward_prefetch=False,
        backward_prefetch="BACKWARD_PRE", state_dict_type="SHARDED_STATE_DICT",
        launch={"machine_rank": 0, "main_training_function": "main", "num_machines": 1, "num_processes": 2,
                "rdzv_backend": "static", "same_network": True, "use_cpu": False}), cfg
    assert cfg.state_dict_options.full_state_dict is False
    full = from_accelerate_config({"fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": True,
                                   "fsdp_cpu_offload_pin_memory": False, "fsdp_version": 2,
                                   "fsdp_reshard_after_forward": False, "mixed_precision": "no"})
    assert full.state_dict_options.full_state_dict and full.state_dict_options.cpu_offload
    assert full.policy == ShardingPolicy(strategy="SHARD_GRAD_OP", offload_policy=CPUOffloadPolicy(pin_memory=False))
    hybrid = from_accelerate_config({"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_reshard_after_forward": False})
    assert hybrid.policy.strategy.value == "HYBRID_SHARD_ZERO2"


def test_policy_from_accelerate_keeps_mixed_precision_and_offload_and_refuses_what_it_cannot_carry():
    p = ShardingPolicy.from_accelerate({"mixed_precision": "bf16", "fsdp_offload_params": True,
                                        "fsdp_auto_wrap_policy": "NO_WRAP"})
    assert p.mp_policy.param_dtype is torch.bfloat16 and isinstance(p.offload_policy, CPUOffloadPolicy)
    with pytest.raises(ValueError, match=r"'sync_module_states': True.*from_accelerate_config\(config\).apply"):
        ShardingPolicy.from_accelerate({"fsdp_sync_module_states": True})


@pytest.mark.parametrize("config,needle", [
    ({"fsdp_backward_prefetch": "BACKWARD_POST"}, "fsdp_backward_prefetch='BACKWARD_POST'"),
    ({"fsdp_backward_prefetch_policy": "BACKWARD_POST"}, "fsdp_backward_prefetch='BACKWARD_POST'"),
    ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type='LOCAL_STATE_DICT'"),
    ({"fsdp_use_orig_params": False}, "fsdp_use_orig_params=False"),
    ({"mixed_precision": "fp16"}, "mixed_precision='fp16'"),
    ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"distributed_type": "DEEPSPEED"}, "distributed_type='DEEPSPEED'"),
    ({"compute_environment": "AMAZON_SAGEMAKER"}, "compute_environment='AMAZON_SAGEMAKER'"),
    ({"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": False}, "fsdp_sync_module_states=False"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 10,
      "fsdp_transformer_layer_cls_to_wrap": "X"}, "fsdp_transformer_layer_cls_to_wrap='X'"),
    ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_min_num_params": 10}, "fsdp_min_num_params=10"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, "fsdp_min_num_params"),
    ({"fsdp_auto_wrap_policy": "LAMBDA"}, "fsdp_auto_wrap_policy='LAMBDA'"),
    ({"fsdp_version": 3}, "fsdp_version=3"),
    ({"fsdp_cpu_offload_pin_memory": True}, "fsdp_cpu_offload_pin_memory"),
    ({"fsdp_sync_module_states": "maybe"}, "fsdp_sync_module_states='maybe'"),
    ({"fsdp_offlaod_params": True}, "fsdp_offlaod_params"),  # a typo is refused, not ignored
    ({"distributed_type": "FSDP", "fsdp_config": {}, "mixed_precison": "bf16"}, "mixed_precison"),
    ({"debug": True}, "debug=True"),
    ({"downcast_bf16": "fp32"}, "downcast_bf16='fp32'"),
    ({"tpu_use_cluster": True}, "tpu_use_cluster=True"),
    ({"deepspeed_config": {"zero_stage": 3}}, "deepspeed_config="),
    ({"parallelism_config": {"parallelism_config_dp_replicate_size": 2}}, "init_mesh(dp_replicate=R, dp_shard=S)"),
    ({"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "dynamo_config="),
], ids=lambda v: None if isinstance(v, dict) else v[:30])
def test_keys_that_cannot_take_effect_are_refused_by_name(config, needle):
    with pytest.raises(ValueError) as e:
        from_accelerate_config(config)
    assert needle in str(e.value), str(e.value)


# -- on real ranks -------------------------------------------------------------------------------
def _llama(seed=0):
    return Llama(CFG, generator=torch.Generator().manual_seed(seed))


def _logits_and_grads(model, tokens):
    logits = model(tokens)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _apply_settings(rank, world_size):
    from shardwise.mesh import init_mesh

    out = {}
    cfg = from_accelerate_config({
        "distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
        "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "fsdp_transformer_layer_cls_to_wrap": "TransformerBlock", "fsdp_offload_params": True,
                        "fsdp_forward_prefetch": True, "fsdp_backward_prefetch": "NO_PREFETCH",
                        "fsdp_limit_all_gathers": False}})
    model = cfg.apply(_llama(), init_mesh())
    tokens = TOKENS[rank * 2: rank * 2 + 2]
    logits, grads = _logits_and_grads(model, tokens)
    out["dtype"] = logits.dtype
    states = [m._fsdp_state() for m in (model, *model.layers)]
    out["offload"] = [s.group.offload for s in states]
    out["fwd"] = [len(s.forward_prefetch or ()) for s in states]
    out["bwd"] = [s.backward_prefetch for s in states]
    out["limit"] = model._fsdp_state().ctx.unshard_limit
    # the same by hand: fully_shard with the policies
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ref = _llama()
    for block in ref.layers:
        fully_shard(block, mesh=init_mesh()["dp_shard"], mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(ref, mesh=init_mesh()["dp_shard"], mp_policy=mp, offload_policy=CPUOffloadPolicy())
    ref_logits, ref_grads = _logits_and_grads(ref, tokens)
    out["same"] = torch.equal(logits, ref_logits) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    # apply_fully_shard takes the policies as keywords too
    kw = apply_fully_shard(_llama(), init_mesh(), ShardingPolicy(layer_cls="TransformerBlock"), mp_policy=mp)
    out["kw_dtype"] = kw(tokens).dtype
    with warnings.catch_warnings(record=True) as caught:  # the launcher's world wins, rank 0 warns
        warnings.simplefilter("always")
        other = from_accelerate_config({"num_processes": 4}).apply(_llama(), init_mesh())
    out["world"] = [str(w.message) for w in caught if "num_processes" in str(w.message)]
    out["world_applied"] = other.output.weight.to_local().shape[0] * 2 == CFG.vocab_size
    return out


def test_apply_carries_out_mixed_precision_offload_prefetch_and_limits():
    for rank, out in enumerate(run_ranks(_apply_settings, 2, timeout=120)):
        assert out["dtype"] == torch.bfloat16 and out["kw_dtype"] == torch.bfloat16, (rank, out)
        assert out["offload"] == [True] * 4, (rank, out)
        assert out["fwd"] == [1, 1, 1, 0], (rank, "explicit forward prefetch: root -> block 0 -> 1 -> 2", out)
        assert out["bwd"] == [[]] * 4, (rank, out)
        assert out["limit"] == 5, (rank, out)
        assert out["same"], (rank, "apply == fully_shard(mp_policy, offload_policy) by hand, bit for bit")
        assert out["world_applied"], (rank, "num_processes: 4 on 2 ranks still shards over the 2 ranks")
        if rank == 0:
            assert len(out["world"]) == 1 and "num_processes=4" in out["world"][0] and "2 ranks" in out["world"][0], out
        else:
            assert out["world"] == [], (rank, "only rank 0 warns", out["world"])


def _sync_from_rank0(rank, world_size):
    from shardwise.mesh import init_mesh

    cfg = from_accelerate_config({"fsdp_sync_module_states": True, "fsdp_cpu_ram_efficient_loading": True,
                                  "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})  # _no_split_modules
    if rank == 0:
        model = _llama(0)
    else:
        with torch.device("meta"):
            model = Llama(CFG)
    cfg.apply(model, init_mesh())
    return {n: p.full_tensor() for n, p in model.named_parameters()}, model(TOKENS)


def test_sync_module_states_and_cpu_ram_efficient_loading_give_rank0s_weights():
    want = _llama(0)
    for rank, (params, logits) in enumerate(run_ranks(_sync_from_rank0, 2, timeout=120)):
        for n, p in want.named_parameters():
            assert torch.equal(params[n], p), (rank, n)
        assert torch.allclose(logits, want(TOKENS), rtol=1e-6, atol=1e-6), rank


class DropBlock(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.lin(x)))


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(DropBlock() for _ in range(3)))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def _train_with_checkpointing(rank, world_size, ac):
    from shardwise.mesh import init_mesh

    torch.manual_seed(0)
    model = DropNet()
    cfg = from_accelerate_config({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                  "fsdp_transformer_layer_cls_to_wrap": "DropBlock",
                                  "fsdp_activation_checkpointing": ac})
    cfg.apply(model, init_mesh())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    saved = []
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, repeat between runs
    for _ in range(3):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}, len(saved)


def test_activation_checkpointing_recomputes_with_the_same_dropout_masks():
    plain = run_ranks(_train_with_checkpointing, 2, False)
    ckpt = run_ranks(_train_with_checkpointing, 2, True)
    for rank in range(2):
        (p0, n0), (p1, n1) = plain[rank], ckpt[rank]
        assert n1 < n0, (rank, "checkpointed blocks save fewer tensors for backward", n0, n1)
        for k in p0:
            assert torch.equal(p0[k], p1[k]), (rank, k, "recompute repeats the dropout mask: bit-identical")


def _sync_from_a_meta_rank0(rank, world_size):
    from shardwise.mesh import init_mesh

    with torch.device("meta"):
        model = Llama(CFG)
    try:
        from_accelerate_config({"fsdp_sync_module_states": True}).apply(model, init_mesh())
    except ValueError as e:
        return str(e)
    return "not refused"


def test_sync_from_a_meta_rank0_is_refused_on_every_rank():
    for msg in run_ranks(_sync_from_a_meta_rank0, 2, timeout=60):
        assert "rank 0's model is on the meta device" in msg, msg
