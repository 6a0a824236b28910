"""Tensor parallelism on the Llama-style model of examples/model.py, against a single process.

Plans as in Megatron-style TP: attention q/k/v colwise and o rowwise, SwiGLU w1/w3 colwise and
w2 rowwise; with sequence parallelism the norms run on sequence shards; the full model adds
a vocabulary-parallel embedding and a class-sharded output head trained with loss_parallel.
The last test applies the same plan with torch's own styles and compares.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo  # noqa: F401  preloaded into the forkserver (DTensor imports it lazily)
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardwise.composable as sw
from examples.model import Llama, LlamaConfig, TransformerBlock
from examples.parallel import block_tp_plan, llama_tp_plan
from tests._dist import run_ranks
from tests.test_tp import assert_close, compare_training, init_, placements_of, rel, tp_mesh


def block_plan(s, sequence_parallel: bool) -> dict:
    """The TP plan of one TransformerBlock (examples/parallel.py); ``s`` supplies the style
    classes (shardwise's or torch's: the same plan code runs on both)."""
    return block_tp_plan(s, sequence_parallel)


def llama_plan(s) -> dict:
    return llama_tp_plan(s)


def uneven(plan: dict) -> dict:
    """The plan with shardwise's opt-in for sequence shards of unequal lengths (a sequence the
    tp size does not divide): every style that lays out plain tensors exchanges their lengths."""
    return {k: dataclasses.replace(v, uneven_shards=True) if hasattr(v, "uneven_shards") else v
            for k, v in plan.items()}


def per_rank_heads(model, tp: int) -> None:
    """Attention reshapes by its head counts: after the split each rank has 1/tp of them."""
    for m in model.modules():
        if hasattr(m, "n_kv_heads"):
            m.n_heads //= tp
            m.n_kv_heads //= tp


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _ce(logits, targets):
    with sw.loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- one block


def _block_parity(rank, world_size, cfg_kw, seq, sequence_parallel):
    cfg = LlamaConfig(**cfg_kw)
    ref = init_(TransformerBlock(cfg), seed=0)
    model = copy.deepcopy(ref)
    plan = block_plan(sw, sequence_parallel)
    if sequence_parallel:  # the block takes and returns the full sequence, splits it inside
        plan[""] = sw.PrepareModuleInputOutput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None),
            use_local_input=True, output_layouts=Shard(1), desired_output_layouts=Replicate())
    if seq % world_size:
        plan = uneven(plan)
    sw.parallelize_module(model, tp_mesh(world_size), plan)
    per_rank_heads(model, world_size)
    pl = placements_of(model)
    assert pl["attention.wq.weight"] == (Shard(0),) and pl["attention.wo.weight"] == (Shard(1),), pl
    assert pl["feed_forward.w1.weight"] == (Shard(0),) and pl["feed_forward.w2.weight"] == (Shard(1),), pl
    assert ("ffn_norm.weight" in pl) == sequence_parallel, pl
    cos, sin = (t[:seq] for t in _rope(cfg))
    g = torch.Generator().manual_seed(1)
    batches = [((torch.randn(2, seq, cfg.dim, generator=g), cos, sin), torch.randn(2, seq, cfg.dim, generator=g))
               for _ in range(3)]
    return compare_training(ref, model, batches, _mse)


def _rope(cfg):
    from examples.model import rotary_tables
    return rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)


@pytest.mark.parametrize(
    "world_size,cfg_kw,seq,sp",
    [
        (2, dict(dim=16, n_heads=4, n_kv_heads=2, ffn_hidden=22), 6, False),
        (2, dict(dim=16, n_heads=4, n_kv_heads=2, ffn_hidden=22), 5, True),
        (4, dict(dim=16, n_heads=4, ffn_hidden=22), 6, True),
    ],
    ids=["tp2-gqa", "tp2-sp-seq5", "tp4-sp-hidden22"],
)
def test_llama_block_matches_single_process(world_size, cfg_kw, seq, sp):
    assert_close(run_ranks(_block_parity, world_size, cfg_kw, seq, sp, timeout=90))


# ---------------------------------------------------------------- whole model, vocab parallel + loss_parallel


def _llama_parity(rank, world_size, vocab, seq):
    kv_heads = 2 if world_size == 2 else 4  # grouped-query on 2 ranks; kv heads must split over tp
    cfg = LlamaConfig(vocab_size=vocab, dim=16, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn_hidden=24,
                      max_seq_len=16)
    ref = Llama(cfg, generator=torch.Generator().manual_seed(0))
    plan = llama_plan(sw) if seq % world_size == 0 else uneven(llama_plan(sw))
    model = sw.parallelize_module(copy.deepcopy(ref), tp_mesh(world_size), plan)
    per_rank_heads(model, world_size)
    pl = placements_of(model)
    assert pl["tok_embeddings.weight"] == (Shard(0),) and pl["output.weight"] == (Shard(0),), pl
    assert pl["norm.weight"] == pl["layers.0.attention_norm.weight"] == (Replicate(),), pl
    g = torch.Generator().manual_seed(1)
    batches = [((torch.randint(0, vocab, (2, seq), generator=g),), torch.randint(0, vocab, (2, seq), generator=g))
               for _ in range(3)]
    logits = model(batches[0][0][0])
    assert isinstance(logits, DTensor), type(logits)
    assert tuple(logits.placements) == (Shard(2),), logits.placements
    return compare_training(ref, model, batches, _ce, lr=1e-3)


@pytest.mark.parametrize("world_size,vocab,seq", [(2, 13, 6), (4, 13, 5)], ids=["tp2-vocab13", "tp4-vocab13-seq5"])
def test_llama_vocab_parallel_and_loss_parallel_match_single_process(world_size, vocab, seq):
    assert_close(run_ranks(_llama_parity, world_size, vocab, seq, timeout=90))


# ---------------------------------------------------------------- torch's styles on the same model


def _interop(rank, world_size):
    import torch.distributed.tensor.parallel as torch_tp

    cfg = LlamaConfig(vocab_size=16, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24, max_seq_len=16)
    base = Llama(cfg, generator=torch.Generator().manual_seed(0))
    ours, theirs, adopted = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    mesh = tp_mesh(world_size)
    sw.parallelize_module(ours, mesh, llama_plan(sw))
    torch_tp.parallelize_module(theirs, mesh, llama_plan(torch_tp))
    sw.parallelize_module(adopted, mesh, llama_plan(torch_tp))  # torch's style objects, shardwise's function
    for m in (ours, theirs, adopted):
        per_rank_heads(m, world_size)
    assert placements_of(ours) == placements_of(theirs) == placements_of(adopted), "same plan, same placements"
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 16, (2, 8), generator=g), torch.randint(0, 16, (2, 8), generator=g)
    out_ours, out_theirs, out_adopted = ours(tokens), theirs(tokens), adopted(tokens)
    errs = {"logits": rel(out_ours, out_theirs)}
    assert torch.equal(out_adopted.full_tensor(), out_ours.full_tensor()), "torch's styles run as shardwise's"
    with sw.loss_parallel():
        loss_ours = F.cross_entropy(out_ours.flatten(0, 1), targets.flatten())
        loss_adopted = F.cross_entropy(out_adopted.flatten(0, 1), targets.flatten())
    loss_ours.backward()
    loss_adopted.backward()
    adopted_params = dict(adopted.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p.grad.full_tensor(), adopted_params[name].grad.full_tensor()), name
    with torch_tp.loss_parallel():
        loss_theirs = F.cross_entropy(out_theirs.flatten(0, 1), targets.flatten())
        loss_theirs.backward()
    errs["loss"] = rel(loss_ours, loss_theirs)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        errs[f"grad:{name}"] = rel(p.grad, theirs_params[name].grad)
    return errs


def test_same_outputs_and_gradients_as_torch_tensor_parallel():
    assert_close(run_ranks(_interop, 2, timeout=90))


def _torch_uneven(rank, world_size):
    import torch.distributed.tensor.parallel as torch_tp

    from tests.test_tp import MLP

    results = {}
    for name, s in (("torch", torch_tp), ("shardwise", sw)):
        model = s.parallelize_module(init_(MLP(6, 7), 0), tp_mesh(world_size),
                                     {"up": s.ColwiseParallel(), "down": s.RowwiseParallel()})
        try:
            model(torch.randn(2, 6, generator=torch.Generator().manual_seed(1)))
            results[name] = "ok"
        except RuntimeError as exc:
            results[name] = str(exc).splitlines()[0]
    return results


def test_hidden_size_7_on_2_ranks_fails_in_torch_rowwise_but_works_here():
    """Documents the claim in docs/tensor_parallel.md (torch 2.13): torch's RowwiseParallel
    views a local [.., 4] / [.., 3] input as 2 * local = 8 / 6 wide and the matmul fails."""
    for r in run_ranks(_torch_uneven, 2):
        assert r["shardwise"] == "ok", r
        assert "reduction dim" in r["torch"], f"torch's Rowwise now handles uneven sizes? update the docs: {r}"
