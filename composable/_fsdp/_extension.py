"""FSDP2's all-gather extension: a parameter whose local shard is a tensor subclass decides
what is all-gathered.

[Note: the all-gather extension]
FSDP2's duck-typed contract (torchao's float8 and int8 training weights implement it). The
parameter's *sharded local tensor*, a tensor subclass, defines

    fsdp_pre_all_gather(mesh)                                          (the first form), or
    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        -> (inputs: tuple[Tensor, ...], metadata)
    fsdp_post_all_gather(outputs: tuple[Tensor, ...], metadata, param_dtype, *, out=None)
        -> (unsharded: Tensor, inner_tensors: tuple[Tensor, ...])    (out is None)
        -> None                                                     (out given: rebuilt in place)

``mesh`` is the shard axis's 1-D mesh, ``outer_size`` / ``outer_stride`` the unsharded (TP-local)
shape and contiguous strides, ``module`` the parameter's module, ``mp_policy`` the unit's policy.
Each input is this rank's piece, of any dtype and shape; ``output_k`` is the rank-major
concatenation of every rank's ``input_k``, shaped ``(-1, *input_k.shape[1:])``. ``param_dtype``
is the policy's ``param_dtype``, else the parameter's dtype.

The sharded parameter keeps the subclass as its local tensor (built as FSDP2 builds it) and owns
its storage (no bytes of the unit's buffer). At each unshard the hook's pieces take segments of
the unit's one all-gather buffer, aligned as [Note: flat buffers] plans (``byte_layout``), in the
dtype and size returned (a float8 weight moves 1 byte an element). After the all-gather each
piece is copied into the parameter's kept output tensors (freed by storage resize at reshard),
and ``fsdp_post_all_gather`` rebuilds the weight: the first time it returns it (it becomes the
unsharded ``nn.Parameter``), later with ``out=`` in place, so saved tensors stay valid. Gradients
are plain tensors and reduce as every other parameter's.

Supported as in FSDP2: dim-0 sharding, mixed units, HSDP, mixed precision (the hook decides the
dtypes), tensor parallelism, ``to_empty`` / ``load_state_dict(assign=True)``. Refused in one line:
another shard dim or uneven sharding (the pieces would need the padded shard's size),
``reshard_after_forward=<int>`` (as FSDP2), CPU offload (not yet) and ``materialize``
(initialise before sharding, or ``to_empty`` and init).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GatherExtension", "has_extension"]


def has_extension(t: torch.Tensor, name: str) -> bool:
    """Whether ``t`` implements the all-gather extension; one hook without the other is an error."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"fully_shard: '{name}' is a {type(t).__name__} with only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; the all-gather extension needs both "
            "fsdp_pre_all_gather and fsdp_post_all_gather")
    return pre


def _pieces(inputs: Any, name: str) -> list[torch.Tensor]:
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(f"fully_shard: fsdp_pre_all_gather of '{name}' returned {type(inputs).__name__} as its "
                        "all-gather inputs; it must return (tuple of tensors, metadata)")
    return list(inputs)


class GatherExtension:
    """The extension state of one parameter ``name`` (its unsharded, TP-local ``shape``):
    the metadata and piece shapes of the last ``pre``, the kept all-gather outputs and the
    tensors ``fsdp_post_all_gather`` said make up the unsharded weight (freed and refilled
    each step). See [Note: the all-gather extension]."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape
        self.metadata: Any = None
        self.sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []
        self.inner: list[torch.Tensor] = []

    def pre(self, local: torch.Tensor, mesh: DeviceMesh, module: nn.Module, mp_policy: Any) -> list[torch.Tensor]:
        """Call ``local.fsdp_pre_all_gather``; this rank's pieces, flattened."""
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        n = len(inspect.signature(hook).parameters)
        if n == 1:
            inputs, self.metadata = hook(mesh)
        elif n == 5:
            stride = torch.empty(self.shape, device="meta").stride()
            inputs, self.metadata = hook(mesh, torch.Size(self.shape), stride, module, mp_policy)
        else:
            raise TypeError(
                f"fully_shard: fsdp_pre_all_gather of '{self.name}' takes {n} arguments; FSDP2's forms are "
                "fsdp_pre_all_gather(mesh) and fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)")
        pieces = _pieces(inputs, self.name)
        self.sizes = [t.size() for t in pieces]
        return [t.reshape(-1) for t in pieces]

    def outputs_for(self, world: int, specs: list[tuple[int, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
        """This parameter's all-gather output tensors (``world * numel`` elements of each
        piece's dtype), allocated the first time and given their storage back after."""
        if [(t.numel(), t.dtype) for t in self.outputs] != [(world * n, d) for n, d in specs]:
            self.outputs = [torch.empty(world * n, dtype=d, device=device) for n, d in specs]
            self.inner = []  # a new layout: the next post builds a new unsharded tensor
        for t in (*self.outputs, *self.inner):
            _alloc(t)
        return [t.data for t in self.outputs]  # written outside autograd ([Note: freeing by storage resize])

    def post(self, local: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        """Call ``local.fsdp_post_all_gather`` on the gathered outputs; the new unsharded tensor,
        or None when ``out`` (the kept one) was rebuilt in place."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.sizes))
        hook = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        metadata, self.metadata = self.metadata, None
        if out is not None and self.inner:
            hook(outputs, metadata, param_dtype, out=out)
            return None
        result = hook(outputs, metadata, param_dtype)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
            raise TypeError(f"fully_shard: fsdp_post_all_gather of '{self.name}' returned {type(result).__name__}; "
                            "without out= it must return (unsharded tensor, tuple of its inner tensors)")
        unsharded, inner = result
        self.inner = list(inner)
        if tuple(unsharded.shape) != self.shape:
            unsharded = torch.as_strided(unsharded, self.shape, torch.empty(self.shape, device="meta").stride(), 0)
        return unsharded

    def free(self) -> None:
        """Drop the bytes of the outputs and of the unsharded weight's inner tensors."""
        for t in (*self.outputs, *self.inner):
            t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() < nbytes:
        t.untyped_storage().resize_(nbytes)
