"""Hugging Face MoE blocks -> `MoE`, weights kept: the module mapping behind the HF plans.

A transformers 5.x sparse MoE block (Mixtral, Qwen2/3-MoE): router ``gate`` (``[E, dim]``,
softmax, ``top_k``, ``norm_topk_prob``), ``experts`` with ``gate_up_proj`` ``[E, 2 hidden, dim]``
(gate rows first) and ``down_proj``; Qwen2-MoE adds ``shared_expert`` and its gate. `moe_from_hf`
builds the same function from the same values (``w1``/``w3`` the halves of ``gate_up_proj``, ``w2
= down_proj``), recognising blocks by structure, not class name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._layer import MoE
from ._style import ExpertParallel
from ._style_tp import ExpertTensorParallel

__all__ = ["is_hf_moe_block", "moe_from_hf", "swap_hf_moe_blocks", "expert_parallel_plan"]


def is_hf_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` has the structure `moe_from_hf` converts (see the module docstring)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (isinstance(getattr(gate, "weight", None), torch.Tensor) and hasattr(gate, "top_k")
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def moe_from_hf(block: nn.Module) -> MoE:
    """The `MoE` equal to the HF sparse block ``block``, holding copies of its weights (same
    dtype and device). ``ValueError`` for an activation other than SiLU or a block of another
    shape."""
    if not is_hf_moe_block(block):
        raise ValueError(f"moe_from_hf: {type(block).__name__} is not a sparse MoE block with gate.weight and "
                         "experts.gate_up_proj / down_proj (transformers 5 Mixtral / Qwen2-MoE / Qwen3-MoE)")
    # HF's modules, read by structure (typed Any: their attributes are not nn.Module's)
    gate: Any = block.gate
    experts: Any = block.experts
    act = getattr(experts, "act_fn", None)
    probe = torch.linspace(-4, 4, 17)
    if act is not None and not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(f"moe_from_hf: experts use {type(act).__name__}; the MoE experts are SwiGLU (SiLU)")
    num_experts, two_hidden, dim = experts.gate_up_proj.shape
    hidden = two_hidden // 2
    shared: Any = getattr(block, "shared_expert", None)
    shared_gate: Any = getattr(block, "shared_expert_gate", None)
    shared_hidden = shared.gate_proj.out_features if shared is not None else 0
    like = experts.gate_up_proj
    moe = MoE(dim, hidden, num_experts, int(gate.top_k), norm_topk_prob=bool(getattr(gate, "norm_topk_prob", True)),
              shared_hidden=shared_hidden, shared_gate=shared_gate is not None)
    moe.to(device=like.device, dtype=like.dtype)
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate.weight)
        moe.experts.w1.copy_(experts.gate_up_proj[:, :hidden])
        moe.experts.w3.copy_(experts.gate_up_proj[:, hidden:])
        moe.experts.w2.copy_(experts.down_proj)
        if shared is not None and moe.shared_experts is not None:
            moe.shared_experts.load_state_dict(
                {k: shared.get_submodule(k.split(".")[0]).weight for k in moe.shared_experts.state_dict()})
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.weight.copy_(shared_gate.weight)
    return moe


def swap_hf_moe_blocks(model: nn.Module) -> list[str]:
    """Replace every HF sparse MoE block in ``model`` by its `moe_from_hf`; returns their names."""
    swapped = [name for name, m in model.named_modules() if name and is_hf_moe_block(m)]
    for name in swapped:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, moe_from_hf(owner.get_submodule(leaf)))
    return swapped


def expert_parallel_plan(model: nn.Module, ep_tp: DeviceMesh | None = None) -> dict[str, ExpertParallel]:
    """``{name: ExpertParallel()}`` for every `MoE` in ``model`` (for ``parallelize_module`` on
    the ep mesh), e.g. after `swap_hf_moe_blocks`; with ``ep_tp`` (``expert_meshes(mesh).ep_tp``)
    ``ExpertTensorParallel(ep_tp)``: each expert's own weights split over ``tp`` too."""
    style = (lambda: ExpertParallel()) if ep_tp is None else (lambda: ExpertTensorParallel(ep_tp))
    return {name: style() for name, m in model.named_modules() if isinstance(m, MoE)}
