"""Hugging Face ``LlamaForCausalLM`` (blocks in ``model.model.layers``) at pp=2 against one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver
import torch.nn.functional as F

from shardwise.composable import PipelineSchedule, pipeline_split
from tests._dist import run_ranks

import transformers  # noqa: E402  (the clients extra; the README's test command installs it)


def _hf_ce(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())


def _reference(batch):
    """A small ``LlamaForCausalLM``, its copy to split, a batch, and the reference loss (its
    gradients are in the reference's ``.grad``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    tok = torch.randint(0, 32, (batch, 9), generator=torch.Generator().manual_seed(1))
    x, y = tok[:, :-1], tok[:, 1:]
    ref_loss = _hf_ce(ref(x), y)
    ref_loss.backward()
    return ref, model, x, y, ref_loss


def _hf(rank, world_size, schedule):
    ref, model, x, y, ref_loss = _reference(4)
    split = pipeline_split(model, cost="time", sample=lambda m: _hf_ce(m(x), y), repeats=1, verbose=False)
    sched = PipelineSchedule(split, schedule=schedule, microbatches=2, loss_fn=_hf_ce)
    losses = sched.step(x, y)
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    names = []
    for n, p in split.module.named_parameters():
        r = ref_grads[n].grad
        worst = max(worst, ((p.grad - r).abs().max() / r.abs().max()).item())
        names.append(n)
    return abs(losses.mean().item() - ref_loss.item()) / ref_loss.item(), worst, names


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_hf_llama_pp2(schedule):
    res = run_ranks(_hf, 2, schedule, timeout=120)
    names = set()
    for loss_err, grad_err, n in res:
        assert loss_err <= 1e-6 and grad_err <= 1e-6, (loss_err, grad_err)
        names |= set(n)
    assert "model.embed_tokens.weight" in res[0][2] and "lm_head.weight" in res[1][2], res
    assert any(n.startswith("model.layers.3.") for n in names)


def _hf_sharded(rank, world_size, compile_blocks):
    """pp=2 x dp_shard=2: each stage's decoder layers and stage module ``fully_shard``-ed,
    optionally each layer compiled first (torchtitan's order: compile, then shard)."""
    import shardwise.composable as sw
    from shardwise.mesh import data_parallel_mesh, init_mesh, pipeline_mesh

    ref, model, x, y, ref_loss = _reference(8)
    mesh = init_mesh(pp=2, dp_shard=2, device_type="cpu")
    dp = data_parallel_mesh(mesh)
    split = pipeline_split(model, pipeline_mesh(mesh), cost="params", verbose=False)
    for st in split.stages:
        for blk in st.blocks:
            if compile_blocks:
                blk.compile(backend="aot_eager")
            sw.fully_shard(blk, mesh=dp)
        sw.fully_shard(st.module, mesh=dp)
    sched = PipelineSchedule(split, schedule="1f1b", microbatches=2, loss_fn=_hf_ce)
    sl = slice(dp.get_local_rank() * 4, (dp.get_local_rank() + 1) * 4)
    losses = sched.step(x[sl], y[sl])
    loss = torch.tensor([losses.mean().item()], dtype=torch.float64)
    torch.distributed.all_reduce(loss, group=dp.get_group())
    ref_grads = dict(ref.named_parameters())
    worst = max(((p.grad.full_tensor() - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item()
                for n, p in split.module.named_parameters())
    return abs(loss.item() / 2 - ref_loss.item()) / ref_loss.item(), worst


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_hf_llama_pp2_x_fsdp(compile_blocks):
    for loss_err, grad_err in run_ranks(_hf_sharded, 4, compile_blocks, timeout=240):
        assert loss_err <= 1e-6 and grad_err <= 1e-6, (loss_err, grad_err)
