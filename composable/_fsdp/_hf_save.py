"""transformers' ``model.save_pretrained(dir)`` on a model sharded by `fully_shard`.

transformers recognises tied weights by storage pointer and writes the tensors it gets from
``state_dict()``; a sharded model's state dict holds DTensors whose shards are views of one
flat buffer per unit, so the plain call fails (``The weights trying to be saved contained
shared tensors ... not properly defined``; torch's FSDP2 fails too). When `fully_shard` makes
the ``FSDP<cls>`` class of a class whose ``save_pretrained`` takes ``state_dict=`` (a
transformers ``PreTrainedModel``), it gives it this ``save_pretrained``: called on **every rank**
without ``state_dict``, it gathers the full state dict (``get_model_state_dict`` with
``full_state_dict=True, cpu_offload=True``: one tensor at a time, each tied weight once and kept
one tensor so transformers writes it once) into rank 0's CPU memory, passes it to
transformers' own ``save_pretrained`` (rank 0 writes; the others pass ``{}``), and ends with a
barrier so no rank reads the folder before it is written. Everything else is transformers'.
Rank 0 holds the whole model in CPU memory, as with Accelerate; the streamed way (one full
tensor at a time) is ``shardwise.checkpoint.save_pretrained(model, dir)``.
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

    def save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        if bound.arguments.get("state_dict") is None:
            bound.arguments["state_dict"] = get_model_state_dict(self, options=_FULL_ON_RANK0)
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    save_pretrained.__doc__ = (f"{cls.__name__}.save_pretrained on a sharded model: call it on every rank "
                               "(shardwise gathers the full state dict to rank 0; see "
                               "shardwise.composable._fsdp._hf_save).\n\n" + (original.__doc__ or ""))
    return {"save_pretrained": save_pretrained}
