"""Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE from tiny configs: their sparse MoE blocks
swapped for `MoE` (weights kept) give the same logits in one process, and with the experts
under `ExpertParallel` on 2 ranks (Mixtral, Qwen2-MoE with its gated shared expert) the same
logits and gradients as the original HF model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardwise.composable import MoE, expert_parallel_plan, parallelize_module, swap_hf_moe_blocks
from tests._dist import run_ranks

import transformers  # noqa: E402  (the clients extra; the README's test command installs it)

TOL = {"rtol": 1e-6, "atol": 1e-6}
COMMON = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32)


def _model(name: str):
    torch.manual_seed(0)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    elif name == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                          num_experts_per_tok=2, shared_expert_intermediate_size=20,
                                          norm_topk_prob=False)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, head_dim=4)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF zero-initializes some routers; random ones route non-trivially
        for n, p in model.named_parameters():
            if "gate" in n:
                p.normal_(0, 0.5)
    return model.eval()


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(10 + rank))


def _loss(model, tokens):
    logits = model(tokens).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_swapped_blocks_compute_the_same(name):
    hf = _model(name)
    ours = copy.deepcopy(hf)
    swapped = swap_hf_moe_blocks(ours)
    assert swapped == ["model.layers.0.mlp", "model.layers.1.mlp"], swapped
    assert all(isinstance(ours.get_submodule(n), MoE) for n in swapped)
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens(0)).logits, hf(_tokens(0)).logits, **TOL)


def _hf_ep(rank, world, name):
    hf = _model(name)
    model = copy.deepcopy(hf)
    swap_hf_moe_blocks(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(model, mesh, expert_parallel_plan(model))
    logits, loss = _loss(model, _tokens(rank))
    loss.backward()
    ref_logits = None
    for r in range(world):  # one process: every rank's batch through the HF model
        lg, lr = _loss(hf, _tokens(r))
        lr.backward()
        if r == rank:
            ref_logits = lg
    torch.testing.assert_close(logits, ref_logits, **TOL)
    hf_params = dict(hf.named_parameters())
    for i in range(2):
        moe, block = model.model.layers[i].mlp, hf.model.layers[i].mlp
        hidden = moe.experts.hidden
        gu = block.experts.gate_up_proj.grad
        pairs = [(moe.experts.w1, gu[:, :hidden]), (moe.experts.w3, gu[:, hidden:]),
                 (moe.experts.w2, block.experts.down_proj.grad)]
        for p, want in pairs:
            assert isinstance(p, DTensor)
            torch.testing.assert_close(p.grad.full_tensor(), want, **TOL)
        g = moe.router.gate.weight.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, block.gate.weight.grad, **TOL)
    emb = model.model.embed_tokens.weight.grad.clone()
    dist.all_reduce(emb)
    torch.testing.assert_close(emb, hf_params["model.embed_tokens.weight"].grad, **TOL)
    return True


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])  # qwen3_moe: Mixtral's structure, swap test above
def test_hf_moe_expert_parallel_matches_hf(name):
    assert run_ranks(_hf_ep, 2, name, timeout=120) == [True, True]
