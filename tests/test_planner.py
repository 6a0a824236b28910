"""plan_memory arithmetic against hand-computed cases and against fully_shard's own shards on a
simulated world (fake process group, meta device); suggest_mesh's choices."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from examples.model import Llama, LlamaConfig
from shardwise.composable import MixedPrecisionPolicy, ShardingPolicy, plan_memory, suggest_mesh
from tests._dist import run_ranks

GiB = 2**30


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 6)  # weight [6, 10], bias [6]

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 7, bias=False)  # [7, 6]: the root's only parameter


def test_full_shard_uneven_rows_by_hand():
    # 4 shard ranks: weight 6 rows -> 2 per rank (2 x 10), bias 6 -> 2, head 7 rows -> 2 (2 x 6)
    plan = plan_memory(Net(), 4, "FULL_SHARD")
    assert [u.name for u in plan.units] == ["blocks.0", "blocks.1", ""]
    block, root = 4 * (20 + 2), 4 * 12
    assert plan.params == plan.grads == 2 * block + root == 224
    assert plan.optimizer == 2 * 224
    full_block, full_root = 4 * 66, 4 * 42
    assert plan.unsharded_forward == full_root  # blocks reshard after forward, the root does not
    assert plan.unsharded_backward == full_root + 2 * full_block  # + the block computing and the prefetched one
    assert plan.root_grads == full_root
    assert plan.grad_buffers == full_block + 4 * 4 * 22 + full_root  # unit grads + reduce-scatter input + root
    assert plan.between_steps == 224 + 448
    assert plan.start_of_backward == 672 + full_root + 0 + full_root
    assert plan.end_of_backward == 672 + 224 + 696 + 784 == plan.peak == plan.upper_bound
    acts = plan_memory(Net(), 4, "FULL_SHARD", activation_bytes=10_000)
    assert acts.peak == acts.start_of_backward == 672 + full_root + 10_000 + full_root
    assert acts.upper_bound == plan.end_of_backward + 10_000
    assert "FULL_SHARD" in str(plan) and "peak" in str(plan)


def test_strategies_by_hand():
    zero2 = plan_memory(Net(), (1, 4), "SHARD_GRAD_OP")
    assert zero2.unsharded_forward == zero2.unsharded_backward == 4 * (66 + 66 + 42)  # every unit stays gathered
    hybrid = plan_memory(Net(), (3, 4), "HYBRID_SHARD")
    assert hybrid.params == 224 and hybrid.mesh_shape == (3, 4, 1)  # sharded within a replica only
    no_shard = plan_memory(Net(), (4, 1), "NO_SHARD")
    assert no_shard.params == 4 * (66 + 66 + 42) and no_shard.unsharded_backward == 0  # the shard is the parameter
    one_unit = plan_memory(Net(), 4, ShardingPolicy("FULL_SHARD"))  # no unit selected: the root only
    assert len(one_unit.units) == 1 and one_unit.unsharded_forward == one_unit.unsharded_backward == 4 * 174
    k2 = plan_memory(Net(), 4, ShardingPolicy("FULL_SHARD", layer_cls="Block", reshard_after_forward=2))
    assert k2.unsharded_forward == 4 * 42 + 4 * 132 // 2  # root + half of each unit
    assert k2.unsharded_backward == k2.unsharded_forward + 2 * 4 * 66  # + two gathered


def test_mixed_precision_tp_and_optimizer_by_hand():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = plan_memory(Net(), 4, "FULL_SHARD", mp_policy=mp)
    assert plan.params == 224  # fp32 master shards
    assert plan.unsharded_backward == 2 * 42 + 2 * 2 * 66 and plan.root_grads == 2 * 42  # gathered in bf16
    assert plan.grad_buffers == 2 * 66 + 4 * 4 * 22 + 2 * 42  # bf16 grads, fp32 reduce-scatter input
    # tp 2: weight [6, 10] -> 3 rows locally -> 2 rows on each of 2 shard ranks; 1-D bias replicated
    tp = plan_memory(Net(), (1, 2, 2), "FULL_SHARD")
    assert tp.params == 2 * 4 * (2 * 10 + 3) + 4 * (2 * 6)  # head [7, 6] -> 4 rows -> 2
    opt = plan_memory(Net(), 4, "FULL_SHARD", optimizer_states=1, optimizer_dtype=torch.bfloat16)
    assert opt.optimizer == 224 // 2


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="HYBRID_SHARD"):
        plan_memory(Net(), (2, 2), "FULL_SHARD")
    with pytest.raises(ValueError, match="dp_replicate > 1"):
        plan_memory(Net(), (1, 4), "HYBRID_SHARD")
    with pytest.raises(ValueError, match="mesh_shape"):
        plan_memory(Net(), (1, 2, 3, 4))
    with pytest.raises(ValueError, match="not submodules"):
        plan_memory(Net(), 4, units=["blocks.7"])


def _simulated_shards(rank, world_size, fake_world, shape, cfg):
    """One rank of a fake world: fully_shard a meta model, return its local shard bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.composable import fully_shard

    dist.init_process_group("fake", rank=0, world_size=fake_world, store=FakeStore())
    mesh = init_device_mesh("cpu", shape)
    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["fsdp8", "hsdp2x4"])
def test_plan_matches_fully_shard_on_a_simulated_world(shape):
    cfg = LlamaConfig(vocab_size=250, dim=40, n_layers=3, n_heads=4, ffn_hidden=100)  # uneven over 4 and 8
    local = run_ranks(_simulated_shards, 1, 8, shape, cfg, init_group=False)[0]
    with torch.device("meta"):
        model = Llama(cfg)
    mesh = (1, 8) if len(shape) == 1 else shape
    plan = plan_memory(model, mesh, "FULL_SHARD" if len(shape) == 1 else "HYBRID_SHARD")
    assert plan.params == local, (plan.params, local)  # rank 0 holds the full padded chunk of everything
    assert plan.params > sum(p.numel() for p in model.parameters()) * 4 // shape[-1]  # padding counted


def _llama_7b():
    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=4096))


def test_suggest_prefers_sharding_in_a_host_and_replicating_across():
    model = _llama_7b()
    s = suggest_mesh(model, hosts=2, gpus_per_host=8, bytes_per_gpu=80 * GiB, activation_bytes=10 * GiB)
    assert (s.dp_replicate, s.dp_shard, s.tp) == (2, 8, 1) and s.strategy.startswith("HYBRID"), str(s)
    assert s.plan.peak <= 0.9 * 80 * GiB and "chose" in s.reasoning[-1]


def test_suggest_shards_across_hosts_then_uses_tp_only_when_needed():
    model = _llama_7b()
    full16 = plan_memory(model, (1, 16), "FULL_SHARD").peak
    s = suggest_mesh(model, hosts=2, gpus_per_host=8, bytes_per_gpu=int(full16 / 0.9) + 1)
    assert (s.dp_replicate, s.dp_shard, s.tp, s.strategy) == (1, 16, 1, "FULL_SHARD"), str(s)
    tight = int(full16 / 0.9) - 2**20  # nothing fits at tp 1 any more
    s = suggest_mesh(model, hosts=2, gpus_per_host=8, bytes_per_gpu=tight)
    assert s.tp == 2 and s.dp_replicate * s.dp_shard == 8, str(s)
    assert "tensor parallelism is needed" in s.reasoning[-1]
    with pytest.raises(ValueError, match="nothing fits"):
        suggest_mesh(model, hosts=1, gpus_per_host=2, bytes_per_gpu=GiB)


def test_cp_shards_parameters_over_dp_shard_times_cp_and_divides_activations():
    """[Note: context parallelism in the plan]: dp_shard 2 x cp 2 plans the parameters as a
    shard axis of 4 ranks; the activations (given as at cp 1) are divided by cp."""
    flat = plan_memory(Net(), (1, 4), "FULL_SHARD", activation_bytes=10_001)
    cp = plan_memory(Net(), (1, 2), "FULL_SHARD", activation_bytes=10_001, cp=2)
    assert (cp.params, cp.grads, cp.optimizer, cp.unsharded_backward, cp.grad_buffers) == \
        (flat.params, flat.grads, flat.optimizer, flat.unsharded_backward, flat.grad_buffers)
    assert cp.activations == 5001 and flat.activations == 10_001  # rounded up
    assert cp.cp == 2 and cp.mesh_shape == (1, 2, 1) and "dp_shard=2 x cp=2" in str(cp)
    only_cp = plan_memory(Net(), (1, 1), "FULL_SHARD", cp=2)  # dp_shard 1: still sharded, over cp
    assert only_cp.params == plan_memory(Net(), (1, 2), "FULL_SHARD").params
    with pytest.raises(ValueError, match="HYBRID_SHARD"):  # the strategy rule reads dp_shard x cp
        plan_memory(Net(), (1, 1), "HYBRID_SHARD_ZERO2", cp=2)
    with pytest.raises(ValueError, match="cp=0 must be an int >= 1"):
        plan_memory(Net(), 4, cp=0)
    with torch.device("meta"):
        llama = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4))
    pipe = [plan_memory(llama, (1, 1), "FULL_SHARD", pp=2, microbatches=2, cp=c, activation_bytes=8000)
            for c in (1, 2)]
    assert all(st.cp == 2 for st in pipe[1].stages) and pipe[1].stages[1].params == \
        plan_memory(llama, (1, 2), "FULL_SHARD", pp=2, microbatches=2).stages[1].params
    assert [st.activations for st in pipe[1].stages] == [-(-a.activations // 2) for a in pipe[0].stages]


def _cp_local_bytes(rank, world_size, cfg):
    from examples.parallel import apply_fsdp
    from shardwise.mesh import data_parallel_mesh, init_mesh

    mesh = init_mesh(dp_shard=2, cp=2, device_type="cpu")
    model = apply_fsdp(Llama(cfg, generator=torch.Generator().manual_seed(0)), data_parallel_mesh(mesh))
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def test_cp_plan_matches_fully_shard_over_dp_shard_cp():
    """The planned parameter bytes of dp_shard 2 x cp 2 are what rank 0 holds after
    ``fully_shard`` on `data_parallel_mesh` of ``init_mesh(dp_shard=2, cp=2)`` (4 gloo ranks)."""
    cfg = LlamaConfig(vocab_size=250, dim=40, n_layers=2, n_heads=4, ffn_hidden=100)  # uneven over 4
    local = run_ranks(_cp_local_bytes, 4, cfg, timeout=60)[0]
    with torch.device("meta"):
        model = Llama(cfg)
    assert plan_memory(model, (1, 2), "FULL_SHARD", cp=2).params == local


def test_suggest_uses_cp_when_activations_do_not_fit_and_before_tp():
    """Long sequences: activations too big at cp 1 (tp 1); with cp_sizes the suggester picks
    cp 2 (a model-parallel degree of 2, tp 1) over tp 2, and shards over dp_shard x cp."""
    model = _llama_7b()
    acts = 120 * GiB  # per rank at cp 1, tp 1
    without = suggest_mesh(model, hosts=1, gpus_per_host=8, bytes_per_gpu=80 * GiB, activation_bytes=acts)
    assert (without.cp, without.tp) == (1, 2), str(without)  # only tensor parallelism divides them
    s = suggest_mesh(model, hosts=1, gpus_per_host=8, bytes_per_gpu=80 * GiB, activation_bytes=acts,
                     cp_sizes=(1, 2, 4))
    assert (s.cp, s.tp, s.dp_replicate * s.dp_shard) == (2, 1, 4), str(s)
    assert s.plan.activations == acts // 2 and s.plan.peak <= 0.9 * 80 * GiB
    assert "context parallelism (cp=2) is needed" in s.reasoning[-1], s.reasoning[-1]
    assert s.strategy == "FULL_SHARD" and s.plan.params == plan_memory(model, (1, 8), "FULL_SHARD").params  # over 4 x 2
    with pytest.raises(ValueError, match="cp_sizes"):
        suggest_mesh(model, hosts=1, gpus_per_host=8, bytes_per_gpu=80 * GiB, cp_sizes=(3,))
