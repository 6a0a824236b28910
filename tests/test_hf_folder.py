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
from shardwise.checkpoint._hf._safetensors import tied_groups
from tests._dist import run_ranks

import transformers  # noqa: E402  (the clients extra; the README's test command installs it)
transformers.logging.set_verbosity_error()


def _gpt2(seed):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"])
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama_hf(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)  # no architectures: save_hf_folder adds it
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


# -- item 5: merge / save_hf_folder write complete save_pretrained folders ------------------------
def _save_plain(model, path):
    """A shardwise checkpoint of an unsharded model with its optimizer, as a training job saves it."""
    from shardwise.checkpoint import get_model_state_dict, get_optimizer_state_dict, save

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(TOKENS, labels=TOKENS).loss.backward()
    optim.step()
    model.eval()
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}, path)


def test_merge_with_config_gives_a_folder_from_pretrained_reads(tmp_path):
    from shardwise.checkpoint import merge_checkpoint

    src = _gpt2(0)
    src.config.save_pretrained(tmp_path / "cfg")  # config.json (+ nothing else)
    _save_plain(src, str(tmp_path / "ck"))
    names = merge_checkpoint(tmp_path / "ck", tmp_path / "hf", config=tmp_path / "cfg")
    assert names == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(got).__name__ == "GPT2LMHeadModel" and got.lm_head.weight is got.transformer.wte.weight
    assert torch.equal(got(TOKENS).logits, src(TOKENS).logits)
    from safetensors import safe_open
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:  # as save_pretrained: one name per tie, no optim
        assert set(f.keys()) == set(src.state_dict()) - {"lm_head.weight"}
    # sharded output: model-0000i-of-0000n + model.safetensors.index.json, from a config object
    llama = _llama_hf(3)
    _save_plain(llama, str(tmp_path / "ck2"))
    with pytest.raises(CheckpointError, match="architectures"):  # a config built in code names no class
        merge_checkpoint(tmp_path / "ck2", tmp_path / "hf2", config=llama.config)
    llama.config.architectures = ["LlamaForCausalLM"]
    names = merge_checkpoint(tmp_path / "ck2", tmp_path / "hf2", config=llama.config, max_shard_bytes=4000)
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(llama.state_dict())
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    assert torch.equal(got(TOKENS).logits, llama(TOKENS).logits)


def test_merge_refuses_folders_from_pretrained_would_misread(tmp_path):
    from shardwise.checkpoint import main, merge_checkpoint, save

    src = _gpt2(0)
    _save_plain(src, str(tmp_path / "ck"))
    bigger = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=16,
                                     architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"another shape.*transformer.wte.weight: \[40, 16\] here, \[40, 32\]"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "a", config=bigger)
    deeper = src.config.to_dict() | {"n_layer": 3, "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(CheckpointError, match=r"missing \(from_pretrained would initialise them randomly\).*h\.2\."):
        merge_checkpoint(tmp_path / "ck", tmp_path / "a", config=deeper)
    with pytest.raises(CheckpointError, match=r"not in the config's GPT2LMHeadModel .*optimizer state\? pass prefix"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "a", prefix="", config=src.config)
    no_arch = {k: v for k, v in src.config.to_dict().items() if k != "architectures"}
    with pytest.raises(CheckpointError, match="architectures"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "a", config=no_arch)
    assert not os.path.exists(tmp_path / "a"), "nothing written"
    # a head trained untied under a config that ties it
    untied = _gpt2(0)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach() + 1)
    save({"model": untied.state_dict()}, str(tmp_path / "untied"))
    with pytest.raises(CheckpointError, match="ties 'lm_head.weight' to 'transformer.wte.weight' but their values"):
        merge_checkpoint(tmp_path / "untied", tmp_path / "a", config=src.config)
    # only the tied copy, not the name save_pretrained keeps (from_pretrained would tie the head to a random wte)
    save({"model": {k: v for k, v in src.state_dict().items() if k != "transformer.wte.weight"}},
         str(tmp_path / "headonly"))
    with pytest.raises(CheckpointError, match="only 'lm_head.weight' is here; save it under 'transformer.wte.weight'"):
        merge_checkpoint(tmp_path / "headonly", tmp_path / "a", config=src.config)
    # only optimizer state: no silent fallback to everything
    save({"optim": {"w": torch.zeros(2)}}, str(tmp_path / "opt"))
    with pytest.raises(CheckpointError, match=r"no 'model/' tensors, only the groups \['optim'\]"):
        merge_checkpoint(tmp_path / "opt", tmp_path / "a")
    # without a config: bare tensors under names from_pretrained does not take for a model
    assert main(["merge", str(tmp_path / "ck"), str(tmp_path / "bare"), "--no-progress"]) == 0
    assert sorted(os.listdir(tmp_path / "bare")) == ["tensors-00001-of-00001.safetensors",
                                                     "tensors.safetensors.index.json"]
    with pytest.raises(OSError):
        transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "bare")
    fresh = _gpt2(2)
    load_safetensors(fresh.state_dict(), tmp_path / "bare")
    assert torch.equal(fresh(TOKENS).logits, src(TOKENS).logits), "default prefix: the model's tensors only"
    # the command line takes the config's folder
    src.config.save_pretrained(tmp_path / "cfg")
    assert main(["merge", str(tmp_path / "ck"), str(tmp_path / "cli"), "--config", str(tmp_path / "cfg"),
                 "--no-progress"]) == 0
    assert main(["merge", str(tmp_path / "ck"), str(tmp_path / "cli2"), "--config", str(tmp_path / "nowhere"),
                 "--no-progress"]) == 1


def _sharded_to_hf(rank, world_size, root):
    from shardwise.checkpoint import get_model_state_dict, save, save_hf_folder
    from shardwise.composable import fully_shard

    out = {}
    for name, model, blocks in [("llama", _llama_hf(4), lambda m: m.model.layers),
                                ("gpt2", _gpt2(4), lambda m: m.transformer.h)]:  # gpt2: tied head
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(TOKENS, labels=TOKENS).loss.backward()
        optim.step()
        names = save_hf_folder(model, os.path.join(root, name, "live"), max_shard_bytes=6000)
        save({"model": get_model_state_dict(model)}, os.path.join(root, name, "ck"))
        out[name] = names, {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def test_save_hf_folder_from_a_sharded_model_and_merge_of_its_checkpoint(tmp_path):
    from shardwise.checkpoint import merge_checkpoint

    results = run_ranks(_sharded_to_hf, 2, str(tmp_path), timeout=120)
    for name, build in (("llama", _llama_hf), ("gpt2", _gpt2)):
        names, full = results[0][name]
        assert len(names) > 1 and results[1][name][0] == names
        ref = build(0)
        ref.load_state_dict(full)
        root = tmp_path / name
        merge_checkpoint(root / "ck", root / "merged", config=root / "live")
        for folder in ("live", "merged"):
            got = transformers.AutoModelForCausalLM.from_pretrained(root / folder).eval()
            assert torch.equal(got(TOKENS).logits, ref(TOKENS).logits), (name, folder)


def _rank0_write_fails(rank, world_size, root, where):
    from shardwise.checkpoint import save_hf_folder
    from shardwise.checkpoint._hf import _folder as _hf_folder
    from shardwise.composable import fully_shard

    model = _llama_hf(4)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    if rank == 0:  # a disk that fills up part way, or a commit that fails: only rank 0 writes
        real = _hf_folder.StreamingWriter

        class Full(real):
            def append(self, t):
                raise OSError(28, "No space left on device")

        if where == "append":
            _hf_folder.StreamingWriter = Full
        else:
            _hf_folder.commit = lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only file system"))
    try:
        save_hf_folder(model, os.path.join(root, "out"), max_shard_bytes=6000)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where", ["append", "commit"])
def test_save_hf_folder_rank0_write_error_is_raised_on_every_rank(tmp_path, where):
    words = {"append": "No space left on device", "commit": "Read-only file system"}[where]
    messages = run_ranks(_rank0_write_fails, 2, str(tmp_path), where, timeout=60)
    assert all(m is not None and words in m and "rank" in m for m in messages), messages
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no folder, no half-written temporary one
