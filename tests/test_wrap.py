"""apply_fully_shard: which modules become units, strategy -> mesh / reshard, parity per strategy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from examples.model import Llama, LlamaConfig, TransformerBlock
from shardwise.composable import (
    FSDPModule,
    ReplicateModule,
    ShardingPolicy,
    ShardingStrategy,
    apply_fully_shard,
    fully_shard,
    select_units,
    strategy_mesh,
)
from tests._compare import maxerr
from tests._dist import run_ranks
from tests._models import Net

TOL = 1e-6
CFG = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=16)


def _llama(cfg=CFG, seed=0):
    return Llama(cfg, generator=torch.Generator().manual_seed(seed))


# -- unit selection (pure) ----------------------------------------------------------------------
class MyBlock(TransformerBlock):
    """A subclass: matches "TransformerBlock" through its base class."""


def test_units_by_class_name_are_bottom_up_and_exclude_the_root():
    m = _llama()
    blocks = ["layers.0", "layers.1", "layers.2"]
    assert select_units(m, ShardingPolicy(layer_cls="TransformerBlock")) == blocks
    assert select_units(m, ShardingPolicy(layer_cls=[TransformerBlock])) == blocks
    assert select_units(m, ShardingPolicy(layer_cls=" TransformerBlock , Embedding,")) == ["tok_embeddings", *blocks]
    nested = select_units(m, ShardingPolicy(layer_cls="Attention,TransformerBlock"))
    assert nested == [u for b in blocks for u in (f"{b}.attention", b)], nested
    assert select_units(m, ShardingPolicy(layer_cls="Llama")) == []  # the root is always last, never listed
    m.layers[1] = MyBlock(CFG)
    assert select_units(m, ShardingPolicy(layer_cls="TransformerBlock")) == blocks


def test_units_from_no_split_modules_and_no_wrap():
    m = _llama()
    assert type(m)._no_split_modules == ["TransformerBlock"]
    assert select_units(m, ShardingPolicy(no_split_modules=True)) == ["layers.0", "layers.1", "layers.2"]
    assert select_units(m, ShardingPolicy()) == []  # Accelerate's NO_WRAP: only the root
    with pytest.raises(ValueError, match=r"Net has no _no_split_modules.*layer_cls=.*'Block'"):
        select_units(Net(), ShardingPolicy(no_split_modules=True))


def test_units_by_parameter_count_skip_containers_and_count_shared_params_once():
    m = _llama()
    per_block = sum(p.numel() for p in m.layers[0].parameters())
    ffn = sum(p.numel() for p in m.layers[0].feed_forward.parameters())
    assert ffn < per_block
    assert select_units(m, ShardingPolicy(min_num_params=per_block)) == ["layers.0", "layers.1", "layers.2"]
    # below the FFN size the FFNs go first, the rest of a block no longer reaches the threshold
    got = select_units(m, ShardingPolicy(min_num_params=ffn))
    assert got == ["layers.0.feed_forward", "layers.1.feed_forward", "layers.2.feed_forward"], got
    # everything: the ModuleList is never a unit by size
    assert "layers" not in select_units(m, ShardingPolicy(min_num_params=1))
    # a tied head counts once, under the first module that holds it
    tied = _llama()
    tied.output.weight = tied.tok_embeddings.weight
    emb = tied.tok_embeddings.weight.numel()
    units = select_units(tied, ShardingPolicy(min_num_params=emb))
    assert "tok_embeddings" in units and "output" not in units, units
    assert "output" in select_units(_llama(), ShardingPolicy(min_num_params=emb))


def test_shared_modules_and_existing_units_are_selected_once():
    m = Net(n_blocks=2)
    m.blocks.append(m.blocks[0])  # the same block reached twice
    assert select_units(m, ShardingPolicy(layer_cls="Block")) == ["blocks.0", "blocks.1"]


def test_unknown_class_names_list_the_classes_present_and_near_misses():
    with pytest.raises(ValueError) as e:
        select_units(_llama(), ShardingPolicy(layer_cls="LlamaDecoderLayer,TransformerBlok"))
    msg = str(e.value)
    for needle in ("['LlamaDecoderLayer', 'TransformerBlok']", "Classes present:", "'RMSNorm'",
                   "'TransformerBlok': did you mean ['TransformerBlock']", "ShardingPolicy(layer_cls=...)"):
        assert needle in msg, msg


def test_policy_is_frozen_and_validates():
    p = ShardingPolicy(strategy="hybrid_shard", layer_cls="A,B")
    assert p.strategy is ShardingStrategy.HYBRID_SHARD and p.layer_cls == ("A", "B")
    with pytest.raises(Exception):
        p.min_num_params = 3
    assert ShardingStrategy.parse(2) is ShardingStrategy.SHARD_GRAD_OP  # Accelerate's numbering
    assert ShardingStrategy.parse("5") is ShardingStrategy.HYBRID_SHARD_ZERO2
    with pytest.raises(ValueError, match="unknown sharding strategy 'ZERO3'.*FULL_SHARD"):
        ShardingPolicy(strategy="ZERO3")
    with pytest.raises(ValueError, match="min_num_params=-1"):
        ShardingPolicy(min_num_params=-1)
    with pytest.raises(ValueError, match="reshard_after_forward=0"):
        ShardingPolicy(reshard_after_forward=0)
    with pytest.raises(TypeError, match="layer_cls"):
        ShardingPolicy(layer_cls=[3])


def test_policy_from_accelerate_config():
    a = ShardingPolicy.from_accelerate({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                        "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": False})
    assert a == ShardingPolicy(strategy="SHARD_GRAD_OP", layer_cls="LlamaDecoderLayer")
    b = ShardingPolicy.from_accelerate({"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                        "fsdp_transformer_layer_cls_to_wrap": ""})
    assert b == ShardingPolicy(strategy="SHARD_GRAD_OP", no_split_modules=True)
    c = ShardingPolicy.from_accelerate({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "1000",
                                        "sharding_strategy": 4})
    assert c == ShardingPolicy(strategy="HYBRID_SHARD", min_num_params=1000)
    assert ShardingPolicy.from_accelerate({}) == ShardingPolicy()


# -- strategies on real ranks ------------------------------------------------------------------
def _strategy_layouts(rank, world_size):
    from shardwise.mesh import init_mesh

    flat, hybrid = init_mesh(), init_mesh(dp_replicate=2, dp_shard=2)
    out = {}
    for strategy, mesh in [("FULL_SHARD", flat), ("SHARD_GRAD_OP", flat), ("NO_SHARD", flat),
                           ("HYBRID_SHARD", hybrid), ("HYBRID_SHARD_ZERO2", hybrid)]:
        model = apply_fully_shard(_llama(), mesh, ShardingPolicy(strategy=strategy, layer_cls="TransformerBlock"))
        units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
        w = model.layers[0].attention.wq.weight
        if strategy == "NO_SHARD":  # [Note: NO_SHARD through replicate]: plain parameters, no units
            model(torch.randint(0, 32, (2, 8))).sum().backward()
            out[strategy] = dict(units=units, replicated=isinstance(model, ReplicateModule),
                                 plain=not any(isinstance(p, DTensor) for p in model.parameters()),
                                 grads=all(p.grad is not None for p in model.parameters()))
            continue
        full = w.full_tensor()
        tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
        logits = model(tokens)
        resharded = {"block": isinstance(model.layers[0].attention.wq.weight, DTensor),
                     "root": isinstance(model.output.weight, DTensor)}
        logits.sum().backward()
        out[strategy] = dict(units=units, mesh=tuple(w.device_mesh.shape), placements=tuple(w.placements),
                             local_is_full=torch.equal(w.to_local(), full), after_forward=resharded,
                             after_backward=all(isinstance(p, DTensor) for p in model.parameters()))
    return out


def test_each_strategy_gives_its_mesh_placements_and_reshard_setting():
    S0, R = Shard(0), Replicate()
    want = {  # mesh shape, placements, block resharded after forward
        "FULL_SHARD": ((4,), (S0,), True),
        "SHARD_GRAD_OP": ((4,), (S0,), False),
        "HYBRID_SHARD": ((2, 2), (R, S0), True),
        "HYBRID_SHARD_ZERO2": ((2, 2), (R, S0), False),
    }
    for rank, got in enumerate(run_ranks(_strategy_layouts, 4, timeout=120)):
        assert got["NO_SHARD"] == dict(units=[], replicated=True, plain=True, grads=True), (rank, got["NO_SHARD"])
        for strategy, (mesh, placements, block_resharded) in want.items():
            g = got[strategy]
            assert g["units"] == ["", "layers.0", "layers.1", "layers.2"], (strategy, g["units"])
            assert (g["mesh"], g["placements"]) == (mesh, placements), (rank, strategy, g)
            assert g["after_forward"] == {"block": block_resharded, "root": False}, (rank, strategy, g)
            assert g["after_backward"], (rank, strategy, "every unit reshards after backward")
            assert not g["local_is_full"], (rank, strategy)


def _mesh_choices(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.mesh import init_mesh

    found = {}

    def expect(key, fn, *needles):
        try:
            fn()
        except (ValueError, TypeError) as e:
            missing = [n for n in needles if n not in str(e)]
            found[key] = "ok" if not missing else f"message lacks {missing}: {e}"
        else:
            found[key] = "no error raised"

    hybrid, flat = init_mesh(dp_replicate=2, dp_shard=2), init_mesh()
    expect("full-on-hsdp", lambda: strategy_mesh("FULL_SHARD", hybrid), "2 replicas x 2 shards", "HYBRID_SHARD",
           "init_mesh(dp_replicate=1, dp_shard=4)")
    expect("zero2-on-hsdp", lambda: strategy_mesh("SHARD_GRAD_OP", hybrid["dp_replicate", "dp_shard"]),
           "HYBRID_SHARD_ZERO2")
    expect("hybrid-on-flat", lambda: strategy_mesh("HYBRID_SHARD", flat), "1 replica x 4 shards", "dp_replicate=R")
    expect("hybrid-on-1d", lambda: strategy_mesh("HYBRID_SHARD_ZERO2", flat["dp_shard"]), "SHARD_GRAD_OP")
    expect("hybrid-no-mesh", lambda: strategy_mesh("HYBRID_SHARD"), "init_mesh(dp_replicate=R, dp_shard=S)")
    with_tp = init_mesh(dp_shard=2, tp=2)
    expect("no-shard-submesh", lambda: strategy_mesh("NO_SHARD", with_tp["dp_shard"]), "covers 2 of 4 ranks",
           "init_device_mesh")
    expect("4d", lambda: strategy_mesh("FULL_SHARD", init_device_mesh("cpu", (1, 1, 2, 2))), "4-D mesh")
    expect("policy", lambda: apply_fully_shard(nn.Linear(2, 2), flat, "FULL_SHARD"), "ShardingPolicy")
    # accepted shapes, and the meshes they give
    found["full-3d"] = tuple(strategy_mesh("FULL_SHARD", flat).mesh.tolist())
    found["full-default"] = tuple(strategy_mesh("FULL_SHARD").mesh.tolist())
    found["full-2d-r1"] = tuple(strategy_mesh("FULL_SHARD", init_device_mesh("cpu", (1, 4))).mesh.tolist())
    found["no-shard-1d"] = strategy_mesh("NO_SHARD", flat["dp_shard"]).mesh.tolist()
    found["no-shard-tp"] = strategy_mesh("NO_SHARD", with_tp).mesh.tolist()
    found["hybrid-3d-tp"] = strategy_mesh("HYBRID_SHARD", init_mesh(dp_replicate=2, dp_shard=1, tp=2)).mesh.tolist()
    return found


def test_meshes_accepted_and_refused_per_strategy():
    for rank, found in enumerate(run_ranks(_mesh_choices, 4, timeout=120)):
        tp = rank % 2
        assert found.pop("full-3d") == found.pop("full-default") == found.pop("full-2d-r1") == (0, 1, 2, 3)
        assert found.pop("no-shard-1d") == [[0], [1], [2], [3]]
        assert found.pop("no-shard-tp") == [[tp], [tp + 2]], (rank, "NO_SHARD keeps the tp axis apart")
        assert found.pop("hybrid-3d-tp") == [[tp], [tp + 2]]
        bad = {k: v for k, v in found.items() if v != "ok"}
        assert not bad, (rank, bad)


# -- parity with one process -------------------------------------------------------------------
def _batches(steps=3, batch=8, seq=9, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _strategy_parity(rank, world_size, policy, replicas):
    from shardwise.mesh import init_mesh

    ref = _llama()
    model = apply_fully_shard(copy.deepcopy(ref), init_mesh(dp_replicate=replicas), policy)
    # SGD, not AdamW: Adam divides by sqrt(v) elementwise, so the ~1e-7 reordering differences of the
    # rank sums flip the sign of near-zero gradients of this Llama into O(lr) parameter differences.
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    worst, per = 0.0, 8 // world_size
    for tokens in _batches():
        ref_loss = _loss(ref, tokens)
        ref_loss.backward()
        ropt.step()
        ropt.zero_grad()
        loss = _loss(model, tokens[rank * per : (rank + 1) * per])  # dp rank == rank on these meshes
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world_size - ref_loss.item()) / ref_loss.item())
    ref_params = dict(ref.named_parameters())
    errs = {n: (((p.full_tensor() if isinstance(p, DTensor) else p.detach()) - ref_params[n]).abs().max() / ref_params[n].abs().max()).item()
            for n, p in model.named_parameters()}
    return worst, errs


@pytest.mark.parametrize("world_size,replicas,policy", [
    (2, 1, ShardingPolicy(strategy="FULL_SHARD", layer_cls="TransformerBlock")),
    (2, 1, ShardingPolicy(strategy="SHARD_GRAD_OP", no_split_modules=True)),
    (4, 1, ShardingPolicy(strategy="NO_SHARD", layer_cls="TransformerBlock")),
    (4, 2, ShardingPolicy(strategy="HYBRID_SHARD", layer_cls="TransformerBlock,Embedding")),
    (4, 2, ShardingPolicy(strategy="HYBRID_SHARD_ZERO2", min_num_params=2000)),
    (4, 1, ShardingPolicy(strategy="FULL_SHARD", layer_cls="TransformerBlock", reshard_after_forward=2)),
], ids=["full_shard-2", "shard_grad_op-2", "no_shard-4", "hybrid_shard-2x2", "hybrid_zero2-2x2", "hpz2-4"])
def test_each_strategy_trains_like_one_process(world_size, replicas, policy):
    for rank, (loss_err, errs) in enumerate(run_ranks(_strategy_parity, world_size, policy, replicas, timeout=120)):
        assert loss_err <= TOL, f"rank {rank}: loss differs by {loss_err:.2e}"
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: parameters differ from the reference: {bad}"


def _ignored_and_existing_units(rank, world_size):
    from shardwise.mesh import init_mesh

    model = _llama()
    fully_shard(model.layers[0], mesh=init_mesh()["dp_shard"])  # already a unit: skipped, not re-sharded
    apply_fully_shard(model, init_mesh(), ShardingPolicy(layer_cls="TransformerBlock"),
                      ignored_params=[model.norm.weight])
    return isinstance(model.norm.weight, DTensor), isinstance(model.layers[1].ffn_norm.weight, DTensor)


def test_ignored_params_and_existing_units():
    assert run_ranks(_ignored_and_existing_units, 2) == [(False, True)] * 2
