"""transformers' ``model.save_pretrained(dir)`` on a model sharded by `fully_shard`.

transformers recognises tied weights by storage pointer and writes the tensors it gets from
``state_dict()``; a sharded model's state dict holds DTensors whose shards are views of one
flat buffer per unit, so the plain call fails (``The weights trying to be saved contained
shared tensors ... not properly defined``; torch's FSDP2 fails too). When `fully_shard` makes
the ``FSDP<cls>`` class of a class whose ``save_pretrained`` takes ``state_dict=`` (a
transformers ``PreTrainedModel``), it gives it this ``save_pretrained``: called on **every rank**
without ``state_dict``, it gathers the full state dict (one tensor at a time, each tied weight
once and kept one tensor so transformers writes it once) into rank 0's CPU memory, passes it to
transformers' own ``save_pretrained`` (rank 0 writes; the others pass ``{}``), and ends with a
barrier so no rank reads the folder before it is written. Everything else is transformers'.
Rank 0 holds the whole model in CPU memory, as with Accelerate; the streamed way (one full
tensor at a time) is ``shardwise.checkpoint.save_pretrained(model, dir)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["save_pretrained_override"]


def _full_on_rank0(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (CPU), ``{}`` elsewhere; collective, the same calls in the
    same order on every rank."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[name] = first.setdefault(id(p), name)
    out: dict[str, torch.Tensor] = {}
    done: dict[str, torch.Tensor | None] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            src = alias.get(key, key)
            if src not in done:
                full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
                done[src] = full.cpu() if rank == 0 else None
            t = done[src]
            if t is not None:
                out[key] = t
    return out


def save_pretrained_override(cls: type) -> dict[str, Callable[..., Any]]:
    """``{"save_pretrained": ...}`` for ``FSDP<cls>`` when ``cls.save_pretrained`` takes
    ``state_dict=``, else ``{}`` (see the module docstring)."""
    original = getattr(cls, "save_pretrained", None)
    if not callable(original):
        return {}
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        return {}
    if "state_dict" not in sig.parameters:
        return {}

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        if bound.arguments.get("state_dict") is None:
            bound.arguments["state_dict"] = _full_on_rank0(self)
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    save_pretrained.__doc__ = (f"{cls.__name__}.save_pretrained on a sharded model: call it on every rank "
                               "(shardwise gathers the full state dict to rank 0; see "
                               "shardwise.composable._fsdp._hf_save).\n\n" + (original.__doc__ or ""))
    return {"save_pretrained": save_pretrained}
