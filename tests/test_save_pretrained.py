"""``save_pretrained`` on a shardwise-sharded Hugging Face model (2 gloo ranks, a tiny Llama,
tied and untied embeddings): shardwise's streamed ``save_pretrained`` (one file and several,
``max_shard_size``, replacing an earlier folder and keeping a tokenizer file), transformers'
own ``model.save_pretrained(dir, state_dict=<full state dict>)`` and the bare
``model.save_pretrained(dir)`` on every rank. ``from_pretrained`` reads
each folder and gives the sharded model's logits exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_on_workers

import transformers  # noqa: E402  (the clients extra; the README's test command installs it)
transformers.logging.set_verbosity_error()

TOKENS = torch.tensor([[1, 5, 7, 2, 9, 3]])


def _llama(seed: int, tied: bool):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()


def _save_all_ways(rank, world_size, root, tied):
    root = os.path.join(root, "tied" if tied else "untied")
    import shardwise.checkpoint as ck
    from shardwise.composable import fully_shard

    model = _llama(3, tied)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(TOKENS, labels=TOKENS).loss.backward()
    optim.step()  # trained: the head and the embedding move (together when tied)
    with torch.no_grad():
        logits = model(TOKENS).logits
    one = ck.save_pretrained(model, os.path.join(root, "one"))
    if rank == 0:  # a tokenizer saved first, then the model over it (and over an earlier save)
        with open(os.path.join(root, "one", "tokenizer.json"), "w") as f:
            f.write("{}")
    dist.barrier()
    again = ck.save_pretrained(model, os.path.join(root, "one"))
    many = ck.save_pretrained(model, os.path.join(root, "many"), max_shard_size="2KB")
    full = ck.get_model_state_dict(model, options=ck.StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.save_pretrained(os.path.join(root, "bare"))  # transformers' own call, on every rank, nothing else
    nfull = len(full)  # transformers empties the dict it is given
    weights = {k: v.clone() for k, v in full.items()}
    model.save_pretrained(os.path.join(root, "hf"), state_dict=full, max_shard_size="2KB")
    dist.barrier()
    return logits, one, again, many, nfull, weights


def _both(rank, world_size, root):
    return {tied: _save_all_ways(rank, world_size, root, tied) for tied in (False, True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_pretrained")
    return root, run_on_workers(_both, 2, str(root), timeout=180)


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_of_a_sharded_model(saved, tied):
    root, ranks = saved
    tmp_path = root / ("tied" if tied else "untied")
    out = [r[tied] for r in ranks]
    logits, one, again, many, nfull, weights = out[0]
    assert one == again == ["model.safetensors"] and len(many) > 1 and out[1][1:4] == (one, again, many)
    assert nfull > 0 and out[1][4] == 0, "full_state_dict + cpu_offload: rank 0 only"
    assert os.path.exists(tmp_path / "one" / "tokenizer.json"), "a replaced folder keeps the user's files"
    assert os.path.exists(tmp_path / "one" / "generation_config.json")
    for folder in ("one", "many", "hf", "bare"):
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder).eval()
        assert got.config.tie_word_embeddings == tied
        loaded = got.state_dict()
        for k, w in weights.items():  # the round trip: every weight bit for bit
            assert torch.equal(loaded[k], w), f"{folder}: {k} differs"
        with torch.no_grad():  # the forward here runs on another thread count than the ranks' (last-bit
            # differences: measured 2.2e-8 .. 3.0e-8 on logits of ~0.3)
            torch.testing.assert_close(got(TOKENS).logits, logits, rtol=1e-6, atol=1e-7,
                                       msg=f"{folder}: from_pretrained gives other logits")
        index = tmp_path / folder / "model.safetensors.index.json"
        if folder in ("many", "hf"):
            names = set(json.loads(index.read_text())["weight_map"])
            assert ("lm_head.weight" in names) != tied, f"{folder}: a tied head is written once, an untied one kept"


def test_max_shard_size_strings():
    from shardwise.checkpoint._hf._save_pretrained import parse_shard_size

    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("500MiB") == 500 * 2**20
    assert parse_shard_size(1234) == 1234 and parse_shard_size("2KB") == 2000
    for bad in ("lots", 0, -1, "0GB", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_shard_size(bad)


def test_only_classes_with_hf_save_pretrained_get_the_override():
    from shardwise.composable._fsdp._hf_save import save_pretrained_override

    assert save_pretrained_override(torch.nn.Linear) == {}

    class Other(torch.nn.Module):
        def save_pretrained(self, path):  # no state_dict= argument: left alone
            return path

    assert save_pretrained_override(Other) == {}
    assert set(save_pretrained_override(transformers.LlamaForCausalLM)) == {"save_pretrained"}
