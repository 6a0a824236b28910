"""``model.save_pretrained(dir)`` on a model sharded by `fully_shard`: transformers' and PEFT's.

The state dict's tensors are ordinary ([Note: ordinary tensors] in ``_sharded_param.py``), so
``torch.save(model.state_dict())`` and ``save_pretrained(dir, state_dict=<full>, is_main_process=
rank == 0)`` need nothing from here. The bare call on every rank fails with FSDP2 too: tied
weights are found through safetensors' ``storage_ptr``, which reads a DTensor's (empty) wrapper
storage, and every rank would write the folder.

When `fully_shard` makes the ``FSDP<cls>`` class of a class whose ``save_pretrained`` takes a
state dict (transformers' ``PreTrainedModel``; PEFT's ``PeftModel`` through ``**kwargs``), it
gives it this ``save_pretrained``. Called on **every rank** without ``state_dict``, it gathers the
full state dict one ``full_tensor()`` at a time (a tied weight once) into rank 0's CPU memory and
passes it to the class's own ``save_pretrained`` (the others pass ``{}``), with
``is_main_process and rank == 0``; a barrier ends it. A LoRA run wanting less memory on rank 0
passes its own ``state_dict=``; the streamed way for a whole model is
``shardwise.checkpoint.save_pretrained(model, dir)``.
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

_MAIN = "is_main_process"


def _full_on_rank0(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0's CPU (``{}`` elsewhere), one tensor gathered at a time;
    a tensor under several names (tied weights) is one tensor."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    sd = model.state_dict(keep_vars=True)
    seen: dict[int, torch.Tensor] = {}
    for v in sd.values():
        if id(v) not in seen:  # full_tensor() is collective: every rank, in the same order
            t = v.full_tensor() if isinstance(v, DTensor) else v
            seen[id(v)] = t.detach().cpu() if rank0 else v
    return {k: seen[id(v)] for k, v in sd.items()} if rank0 else {}


def _takes_state_dict(sig: inspect.Signature) -> bool:
    """Whether a ``save_pretrained`` with this signature takes a state dict: as a parameter
    (transformers) or through ``**kwargs`` beside ``is_main_process`` (PEFT)."""
    params = sig.parameters
    if "state_dict" in params:
        return True
    return _MAIN in params and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def save_pretrained_override(cls: type) -> dict[str, Callable[..., Any]]:
    """``{"save_pretrained": ...}`` for ``FSDP<cls>`` when ``cls.save_pretrained`` takes a state
    dict (``state_dict=``, or through ``**kwargs`` beside ``is_main_process``), else ``{}`` (see
    the module docstring)."""
    original = getattr(cls, "save_pretrained", None)
    if not callable(original):
        return {}
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        return {}
    if not _takes_state_dict(sig):
        return {}
    # where ``state_dict`` goes in the bound arguments: its own parameter, or PEFT's ``**kwargs``
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    in_kwargs = var_kw if "state_dict" not in sig.parameters else None

    def save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        holder = bound.arguments.setdefault(in_kwargs, {}) if in_kwargs else bound.arguments
        if holder.get("state_dict") is None:
            holder["state_dict"] = _full_on_rank0(self)
        if _MAIN in sig.parameters and dist.is_available() and dist.is_initialized():
            main = bound.arguments.get(_MAIN, sig.parameters[_MAIN].default)
            bound.arguments[_MAIN] = bool(main) and dist.get_rank() == 0  # rank 0 holds the tensors
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    save_pretrained.__doc__ = (f"{cls.__name__}.save_pretrained on a sharded model: call it on every rank "
                               "(shardwise gathers the full state dict to rank 0, which writes; see "
                               "shardwise.composable._fsdp._hf_save).\n\n" + (original.__doc__ or ""))
    return {"save_pretrained": save_pretrained}
