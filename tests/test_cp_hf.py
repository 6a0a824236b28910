"""Hugging Face ``LlamaForCausalLM`` (a tiny config, ``sdpa`` attention, grouped-query heads)
under context parallelism: each cp rank feeds its zigzag shard of the tokens with its
``position_ids`` (HF's rotary reads them) and an all-ones ``attention_mask`` (so that HF passes
no mask and ``is_causal=True``), the ``self_attn`` modules routed to the ring. Logits and
gradients (summed over the cp ranks) equal one process on the whole sequence (fp32, 1e-6 of
the largest value)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM  # at the top: the forkserver imports it once, not each rank

from shardwise.composable import context_parallel, shard_sequence, zigzag_positions
from tests._compare import maxerr
from tests._dist import run_ranks

TOL = 1e-6


def _hf(rank, world_size, method):
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    seq = 4 * world_size
    tok = torch.randint(0, 32, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = tok[:, :-1], tok[:, 1:]
    ref_logits = ref(x).logits
    F.cross_entropy(ref_logits.flatten(0, 1), y.flatten(), reduction="sum").div(y.numel()).backward()

    xs, ys = shard_sequence(x, rank, world_size), shard_sequence(y, rank, world_size)
    pos = zigzag_positions(seq, rank, world_size).expand(2, -1)
    with context_parallel([layer.self_attn for layer in model.model.layers], None, method=method):
        logits = model(input_ids=xs, position_ids=pos, attention_mask=torch.ones_like(xs)).logits
    # the loss of the global mean: this rank's token sum over the global token count
    F.cross_entropy(logits.flatten(0, 1), ys.flatten(), reduction="sum").div(y.numel()).backward()
    worst = {"logits": ((logits - shard_sequence(ref_logits, rank, world_size)).abs().max()
                        / ref_logits.abs().max()).item()}
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        worst[name] = ((g - r.grad).abs().max() / r.grad.abs().max()).item()
    return worst


@pytest.mark.parametrize("cp,method", [(2, "ring"), (4, "allgather")])
def test_hf_llama_matches_one_process(cp, method):
    for rank, worst in enumerate(run_ranks(_hf, cp, method, timeout=120)):
        bad = {k: v for k, v in worst.items() if not v <= TOL}
        assert not bad, (rank, bad)
