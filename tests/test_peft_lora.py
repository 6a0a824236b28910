"""LoRA with PEFT on shardwise (2 gloo ranks, a tiny Hugging Face Llama built from a config): a
fine-tune whose bare ``model.save_pretrained(dir)`` on the sharded PEFT model writes the adapter
folder that ``PeftModel.from_pretrained`` reloads in one process with the sharded model's
logits exactly (the same files and tensor names one process writes), and the merged export,
PEFT's own ``merge_and_unload()`` on the sharded model then the streamed
``shardwise.checkpoint.save_pretrained``, which ``AutoModelForCausalLM.from_pretrained`` loads
with the logits of one process merging the same adapter.

The training itself is checked against torch's FSDP2 and one process in
tests/compat/test_peft_lora.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_on_workers
from tests._lora import LR, PROMPT, base_model, batch, peft_model, rel_err, shard

import peft  # noqa: E402,F401  (the clients extra; the README's test command installs it)
import transformers  # noqa: E402
transformers.logging.set_verbosity_error()

WORLD = 2
TOL = 1e-6


def _fine_tune_and_save(rank, world_size, root):
    import shardwise.checkpoint as ck
    from shardwise.composable import fully_shard

    model = shard(peft_model(0), fully_shard, None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    per = 4 // world_size
    for step in range(3):
        model(**batch(step, slice(rank * per, (rank + 1) * per))).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    adapter = os.path.join(root, "adapter")
    model.save_pretrained(adapter)  # PEFT's own call, on every rank, nothing else
    written = sorted(os.listdir(adapter))  # every rank: the barrier at its end means the folder is complete
    again = os.path.join(root, "adapter_given")  # the lean form: the caller's state dict, adapters only
    sd = ck.get_model_state_dict(model, options=ck.StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=True))
    model.save_pretrained(again, state_dict=sd)
    # merged export: PEFT's merge_and_unload on the sharded model, then the streamed HF writer
    merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters()), "merge_and_unload left adapters"
    files = ck.save_pretrained(merged, os.path.join(root, "merged"))
    dist.barrier()
    return logits, written, files


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_lora")
    return root, run_on_workers(_fine_tune_and_save, WORLD, str(root), timeout=240)


def test_adapter_folder_reloads_with_identical_logits(saved):
    from peft import PeftModel
    from safetensors.torch import load_file

    root, ranks = saved
    logits, written, _ = ranks[0]
    assert ranks[1][1] == written == ["README.md", "adapter_config.json", "adapter_model.safetensors"], written
    back = PeftModel.from_pretrained(base_model(0), str(root / "adapter")).eval()
    with torch.no_grad():
        got = back(input_ids=PROMPT).logits
    assert torch.equal(got, logits), f"reloaded adapters: logits off by {rel_err(got, logits)}"
    # the same tensor names (``base_model.model.`` prefix, no adapter name) one process writes
    one = peft_model(0)
    one.save_pretrained(str(root / "one_process"))
    want = load_file(root / "one_process" / "adapter_model.safetensors")
    have = load_file(root / "adapter" / "adapter_model.safetensors")
    assert have.keys() == want.keys() and all("lora_" in k for k in have), sorted(set(have) ^ set(want))
    assert all(k.startswith("base_model.model.model.layers.") for k in have), sorted(have)
    cfg = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and sorted(cfg["target_modules"]) == sorted(["q_proj", "v_proj", "down_proj"])
    lean = load_file(root / "adapter_given" / "adapter_model.safetensors")
    assert lean.keys() == have.keys() and all(torch.equal(lean[k], have[k]) for k in have), \
        "save_pretrained(state_dict=<adapters only>) wrote other tensors"
    moved = [k for k, v in have.items() if "lora_B" in k and not torch.equal(v, torch.zeros_like(v))]
    assert moved, "the adapters did not train (lora_B is still 0)"


def test_merged_export_loads_with_the_merged_logits(saved):
    from peft import PeftModel

    root, ranks = saved
    logits, _, files = ranks[0]
    assert files == ["model.safetensors"] and ranks[1][2] == files
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(root / "merged"), attn_implementation="eager").eval()
    assert not any("lora_" in n or "base_layer" in n for n in merged.state_dict()), "adapter names in the export"
    one = PeftModel.from_pretrained(base_model(0), str(root / "adapter")).merge_and_unload().eval()
    with torch.no_grad():
        got, want = merged(input_ids=PROMPT).logits, one(input_ids=PROMPT).logits
    assert rel_err(got, want) <= TOL, f"merged export vs one process's merge: {rel_err(got, want)}"
    sd, wsd = merged.state_dict(), one.state_dict()
    bad = {k: rel_err(sd[k], wsd[k]) for k in wsd if not torch.equal(sd[k], wsd[k])}
    assert sd.keys() == wsd.keys() and max(bad.values(), default=0.0) <= TOL, bad
    # merging changes the arithmetic, not the function: the adapter model's logits within fp32 rounding
    assert rel_err(got, logits) <= TOL, f"merged vs unmerged logits: {rel_err(got, logits)}"
