"""Hugging Face folders: tied weights on load (load_safetensors), complete save_pretrained-style export."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from examples.model import Llama, LlamaConfig
from shardwise.checkpoint import CheckpointError, load_safetensors
from shardwise.checkpoint._hf import tied_groups
from tests._dist import run_ranks

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _gpt2(seed):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama_hf(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


TOKENS = torch.tensor([[1, 5, 7, 2, 9, 3]])


# -- item 6: strict loading understands ties ------------------------------------------------------
def test_strict_load_of_a_save_pretrained_folder_with_tied_weights(tmp_path):
    src = _gpt2(0)
    src.save_pretrained(tmp_path / "gpt2")
    from safetensors import safe_open
    with safe_open(tmp_path / "gpt2" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys(), "save_pretrained drops the tied duplicate"
    dst = _gpt2(1)
    assert not torch.equal(dst.transformer.wte.weight, src.transformer.wte.weight)
    stats = load_safetensors(dst.state_dict(), tmp_path / "gpt2")  # strict=True by default
    assert dst.lm_head.weight is dst.transformer.wte.weight
    assert torch.equal(dst(TOKENS).logits, src(TOKENS).logits)
    assert stats.tensors == len(dst.state_dict()) - 1


class _MoE(nn.Module):
    def __init__(self, names, tie=False):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.experts = nn.ModuleDict({n: nn.Linear(4, 4) for n in names})
        self.head = nn.Linear(4, 5, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_strict_load_still_fails_on_real_misses(tmp_path):
    save_file({k: v.contiguous() for k, v in _MoE(["e0", "e1"]).state_dict().items()}, tmp_path / "moe.safetensors")
    target = _MoE(["0", "1"])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_safetensors(target.state_dict(), tmp_path / "moe.safetensors")
    assert "tensor 'experts.0.weight' is not in safetensors" in str(e.value), e.value
    assert "experts.e0.weight" in str(e.value), "the similar names are listed"
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items()), "nothing was written"
    # a tied pair with neither name in the file is still missing
    sd = {k: v for k, v in _MoE(["a"], tie=True).state_dict().items() if k not in ("emb.weight", "head.weight")}
    save_file(sd, tmp_path / "untied.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'emb.weight' is not in.*\n.*tensor 'head.weight' is not in"):
        load_safetensors(_MoE(["a"], tie=True).state_dict(), tmp_path / "untied.safetensors")
    # an untied model whose head is missing from the file: a real miss, not a tie
    sd = {k: v for k, v in _MoE(["a"]).state_dict().items() if k != "head.weight"}
    save_file(sd, tmp_path / "nohead.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'head.weight' is not in"):
        load_safetensors(_MoE(["a"]).state_dict(), tmp_path / "nohead.safetensors")
    # non-strict loads what is there
    load_safetensors(_MoE(["a"]).state_dict(), tmp_path / "nohead.safetensors", strict=False)


def _load_tied_sharded(rank, world_size, path):
    from shardwise.composable import fully_shard
    from shardwise.mesh import init_mesh

    cfg = LlamaConfig(vocab_size=24, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    model = Llama(cfg, generator=torch.Generator().manual_seed(5))
    model.output.weight = model.tok_embeddings.weight
    mesh = init_mesh()["dp_shard"]
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    assert tied_groups(sd) == [["tok_embeddings.weight", "output.weight"]], tied_groups(sd)
    load_safetensors({"model": sd}, path, prefix="model/")
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_tied_load_into_a_sharded_model(tmp_path):
    cfg = LlamaConfig(vocab_size=24, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    ref = Llama(cfg, generator=torch.Generator().manual_seed(9))
    ref.output.weight = ref.tok_embeddings.weight
    save_file({k: v.contiguous() for k, v in ref.state_dict().items() if k != "output.weight"},
              tmp_path / "tied.safetensors")
    for got in run_ranks(_load_tied_sharded, 2, str(tmp_path / "tied.safetensors")):
        for k, v in ref.state_dict().items():
            assert torch.equal(got[k], v), k
