"""``model.save_pretrained(dir)`` on a model sharded by `fully_shard`: transformers' and PEFT's.

transformers recognises tied weights by storage pointer and writes the tensors it gets from
``state_dict()``; a sharded model's state dict holds DTensors whose shards are views of one
flat buffer per unit, so the plain call fails (``The weights trying to be saved contained
shared tensors ... not properly defined``; torch's FSDP2 fails too). PEFT's
``PeftModel.save_pretrained`` fails the same way (``Attempted to access the data pointer on an
invalid python storage``, with torch's FSDP2 as well), and on every rank it would write.

When `fully_shard` makes the ``FSDP<cls>`` class of a class whose ``save_pretrained`` takes a
state dict, it gives it this ``save_pretrained``. Two forms are recognised:

* ``state_dict=`` a named parameter (a transformers ``PreTrainedModel``);
* ``state_dict`` read from ``**kwargs`` next to an ``is_main_process`` parameter (a PEFT
  ``PeftModel``: ``get_peft_model_state_dict(self, state_dict=kwargs.get("state_dict"))``
  picks the adapter's tensors out of it and renames them).

Called on **every rank** without ``state_dict``, it gathers the full state dict
(``get_model_state_dict`` with ``full_state_dict=True, cpu_offload=True``: one tensor at a
time, each tied weight once and kept one tensor so transformers writes it once) into rank 0's
CPU memory, passes it to the class's own ``save_pretrained`` (the others pass ``{}``), and ends
with a barrier so no rank reads the folder before it is written. Only rank 0 holds the tensors,
so only rank 0 writes: ``is_main_process`` becomes ``is_main_process and rank == 0`` (PEFT would
otherwise write an empty adapter file from every other rank; transformers already writes on
rank 0 only). Everything else is the class's own: PEFT still chooses which tensors are the
adapter's (LoRA matrices, ``modules_to_save``, embeddings when it saves them), every adapter
of ``selected_adapters``, the adapter config and model card.

Rank 0 holds the whole model in CPU memory, as with Accelerate (PEFT's choice of tensors can
need frozen ones: inactive adapters, resized embeddings); a LoRA run that wants less passes its
own ``state_dict=``, e.g. ``get_model_state_dict(model, options=StateDictOptions(
full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))``, and the rest is the same.
The streamed way for a whole model (one full tensor at a time) is
``shardwise.checkpoint.save_pretrained(model, dir)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from shardwise.checkpoint import StateDictOptions, get_model_state_dict

__all__ = ["save_pretrained_override"]

_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the full state dict, on rank 0's CPU
_MAIN = "is_main_process"


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
            holder["state_dict"] = get_model_state_dict(self, options=_FULL_ON_RANK0)
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
