"""The tiny PEFT LoRA model the LoRA tests share: a Hugging Face Llama built from a config (no
download), LoRA adapters on the attention and MLP projections, its units, data and checks.

transformers and peft are imported inside the functions: rank bodies call them, so the pytest
process and the forkserver never import either."""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 48
TARGETS = ("q_proj", "v_proj", "down_proj")
LR = 1e-2


def base_model(seed: int = 0) -> Any:
    """A tiny ``LlamaForCausalLM``: 2 layers, fp32, eager attention, untied head."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def lora_config(**kw: Any) -> Any:
    """LoRA rank 4 on ``TARGETS``; PEFT's default init (B = 0), no dropout."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": list(TARGETS), "lora_dropout": 0.0, **kw})


def peft_model(seed: int = 0, **kw: Any) -> Any:
    """``get_peft_model(base_model(seed), lora_config(**kw))``; the adapters' init drawn from ``seed + 1``."""
    from peft import get_peft_model

    base = base_model(seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, lora_config(**kw))


def layers(model: Any) -> list:
    """The decoder layers of a PEFT-wrapped Llama (``base_model.model.model.layers``)."""
    return list(model.get_base_model().model.layers)


def shard(model: Any, fully_shard: Callable, mesh: Any) -> Any:
    """One unit per decoder layer (its frozen base weights and trainable adapters together),
    then the PEFT model as the root, as Accelerate's FSDP2 does."""
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
    """Step ``step``'s 4 sequences of 8 tokens (labels = inputs), or the rows ``rows`` of them."""
    ids = torch.randint(2, VOCAB, (4, 8), generator=torch.Generator().manual_seed(100 + step))
    if rows is not None:
        ids = ids[rows]
    return {"input_ids": ids, "labels": ids.clone()}


PROMPT = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
