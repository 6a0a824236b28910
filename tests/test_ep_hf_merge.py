"""``merge`` and `save_hf_folder` write MoE models under Hugging Face's per-expert names (Mixtral's
``block_sparse_moe.experts.E.w1.weight``, Qwen2/3-MoE's ``mlp.experts.E.gate_proj.weight``): the
same names ``save_pretrained`` writes, and ``from_pretrained`` of the folder gives the original
logits exactly. From a swapped model's stacked tensors (saved in one process and under
`ExpertParallel` on 2 ranks) and from an unswapped model's fused ones."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from shardwise.checkpoint import CheckpointError, merge_checkpoint, save, save_hf_folder
from shardwise.composable import expert_parallel_plan, parallelize_module, swap_hf_moe_blocks
from tests._dist import run_ranks
from tests.test_ep_hf import _model

import safetensors  # noqa: E402
import transformers  # noqa: E402  (the clients extra; the README's test command installs it)

TOKENS = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(5))
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _keys(folder) -> set[str]:
    out: set[str] = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(folder, f), "pt") as h:
                out |= set(h.keys())
    return out


def _check(folder, hf, want_keys: set[str]) -> None:
    assert _keys(folder) == want_keys
    got = type(hf).from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(got(TOKENS).logits, hf(TOKENS).logits)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_merge_and_hf_folder_write_per_expert_names(name, tmp_path):
    hf = _model(name)
    hf.config.architectures = [ARCH[name]]
    hf.save_pretrained(tmp_path / "pretrained")
    want = _keys(tmp_path / "pretrained")
    per_expert = "block_sparse_moe.experts.3.w2.weight" if name == "mixtral" else "mlp.experts.3.down_proj.weight"
    assert f"model.layers.1.{per_expert}" in want, sorted(want)[:20]
    ours = copy.deepcopy(hf)
    swap_hf_moe_blocks(ours)
    assert "model.layers.0.mlp.experts.w1" in ours.state_dict()
    save({"model": ours.state_dict()}, str(tmp_path / "ck"))
    merge_checkpoint(tmp_path / "ck", tmp_path / "merged", config=hf.config)
    _check(tmp_path / "merged", hf, want)
    save_hf_folder(ours, tmp_path / "live", config=hf.config)
    _check(tmp_path / "live", hf, want)
    save({"model": hf.state_dict()}, str(tmp_path / "fused"))  # an unswapped model: fused experts
    merge_checkpoint(tmp_path / "fused", tmp_path / "from_fused", config=hf.config)
    _check(tmp_path / "from_fused", hf, want)


def test_stacked_experts_refused_for_an_architecture_without_a_mapping(tmp_path):
    hf = _model("mixtral")
    ours = copy.deepcopy(hf)
    swap_hf_moe_blocks(ours)
    save({"model": ours.state_dict()}, str(tmp_path / "ck"))
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                   architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match="no per-expert name mapping"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "out", config=cfg)
    assert not (tmp_path / "out").exists()


def _save_ep(rank, world, path, out):
    hf = _model("mixtral")
    hf.config.architectures = [ARCH["mixtral"]]
    swap_hf_moe_blocks(hf)
    parallelize_module(hf, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), expert_parallel_plan(hf))
    save({"model": hf.state_dict()}, path)
    save_hf_folder(hf, out, config=hf.config)
    return hf.model.layers[0].mlp.experts.w1.to_local().shape[0]


def test_expert_parallel_checkpoint_merges_to_hf(tmp_path):
    assert run_ranks(_save_ep, 2, str(tmp_path / "ck"), str(tmp_path / "live"), timeout=90) == [2, 2]
    hf = _model("mixtral")
    hf.config.architectures = [ARCH["mixtral"]]
    hf.save_pretrained(tmp_path / "pretrained")
    merge_checkpoint(tmp_path / "ck", tmp_path / "merged", config=hf.config)
    for folder in ("merged", "live"):
        _check(tmp_path / folder, hf, _keys(tmp_path / "pretrained"))
