"""Routing a model's ``scaled_dot_product_attention`` calls to `context_parallel_attention`.

`route_attention(modules, group)` makes every SDPA call made while one of ``modules`` runs its
forward the context-parallel attention over ``group`` (with the call's ``is_causal``, ``scale``
and GQA arguments); calls elsewhere are untouched. `context_parallel` is the same as a ``with``.

[Note: routing by a function mode scoped to modules]
The route is a public ``TorchFunctionMode`` answering only SDPA, entered around each chosen
module's ``forward`` by an instance attribute wrapping it: no model edit, no attention class
named. Wrapping ``forward`` (not a pre/post-hook pair) means an exception cannot leave the mode
on; ``fully_shard``'s hooks and activation checkpointing call the wrapped ``forward``. Backward
needs no mode (`context_parallel_attention` is an autograd ``Function``). A call it cannot answer
is refused by name: an explicit ``attn_mask`` (pass ``is_causal=True``; for HF models an all-ones
``attention_mask``), ``dropout_p > 0``, or differing head counts without ``enable_gqa``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from ._attention import METHODS, context_parallel_attention

__all__ = ["RouteHandle", "route_attention", "context_parallel"]

_SDPA = F.scaled_dot_product_attention


class _CPMode(TorchFunctionMode):
    def __init__(self, group: dist.ProcessGroup | None, method: str) -> None:
        super().__init__()
        self.group, self.method = group, method

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        return self.attention(*args, **kwargs)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError("context parallelism: scaled_dot_product_attention got an attn_mask, but each rank holds "
                             "only its zigzag shard of the sequence; pass is_causal=True instead of a causal mask "
                             "(Hugging Face models: pass attention_mask=torch.ones(...) so they use is_causal)")
        if dropout_p:
            raise ValueError(f"context parallelism: scaled_dot_product_attention with dropout_p={dropout_p} is not "
                             "supported; set the attention dropout to 0")
        if query.shape[-3] != key.shape[-3] and not enable_gqa:
            raise ValueError(f"context parallelism: {query.shape[-3]} query heads and {key.shape[-3]} key heads "
                             "without enable_gqa=True (as scaled_dot_product_attention itself requires)")
        return context_parallel_attention(query, key, value, self.group, is_causal=is_causal, scale=scale,
                                          method=self.method)


def _group(group: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"context parallelism: pass the 1-D cp mesh (shardwise.mesh.cp_mesh(mesh) or "
                             f"mesh['cp']), got a {group.ndim}-D mesh {group.mesh_dim_names}")
        return group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"context parallelism: group must be a 1-D DeviceMesh, a ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return group


@dataclass
class RouteHandle:
    """What `route_attention` changed; ``remove()`` restores every module's ``forward``."""

    patched: list[tuple[nn.Module, Any]] = field(default_factory=list)

    def remove(self) -> None:
        for module, old in reversed(self.patched):
            if old is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = old
        self.patched.clear()


def route_attention(modules: nn.Module | Iterable[nn.Module], group: DeviceMesh | dist.ProcessGroup | None,
                    *, method: str = "ring") -> RouteHandle:
    """Route the SDPA calls of ``modules`` (submodules included) to `context_parallel_attention`
    over the cp ``group`` (a 1-D mesh, a process group or None) with ``method``; their inputs must
    be this rank's zigzag shards with its positions' rotary embeddings. Returns a `RouteHandle`."""
    if method not in METHODS:
        raise ValueError(f"route_attention: method={method!r}; use one of {METHODS}")
    pg = _group(group)
    chosen = [modules] if isinstance(modules, nn.Module) else list(modules)
    if not chosen or not all(isinstance(m, nn.Module) for m in chosen):
        raise TypeError("route_attention: modules must be an nn.Module or a non-empty iterable of them")
    handle = RouteHandle()
    for module in chosen:
        if getattr(module.forward, "_shardwise_cp_route", False):
            handle.remove()
            raise ValueError(f"route_attention: {type(module).__name__} is already routed; remove() its handle first")
        old = module.__dict__.get("forward")

        @functools.wraps(module.forward)
        def forward(*args: Any, _inner: Any = module.forward, **kwargs: Any) -> Any:
            with _CPMode(pg, method):
                return _inner(*args, **kwargs)

        forward._shardwise_cp_route = True  # type: ignore[attr-defined]
        module.forward = forward
        handle.patched.append((module, old))
    return handle


@contextlib.contextmanager
def context_parallel(modules: nn.Module | Iterable[nn.Module], group: DeviceMesh | dist.ProcessGroup | None, *,
                     method: str = "ring") -> Iterator[RouteHandle]:
    """`route_attention` for the duration of a ``with`` block (removed on exit, also on error)."""
    handle = route_attention(modules, group, method=method)
    try:
        yield handle
    finally:
        handle.remove()
