"""The traced unit: ``fully_shard`` inside ``torch.compile(model, fullgraph=True)``.

[Note: the traced unit]
The eager unit's hooks cannot be traced by dynamo (storage resizes, parameter swaps, c10d work
objects, engine callbacks). When the *top* unit (the model's root) runs its forward inside a
dynamo trace, every unit under it takes this path instead, and the step is one graph:

* forward pre-hook: one all-gather of the unit's flat sharded buffer (or its ``param_dtype``
  copy, laid out by the same ``ag_offsets``) through a traced functional collective; each
  parameter is viewed out of the ``[W, B]`` bytes by its ``ShardLayout`` and put on its modules.
  The gather is an autograd ``Function`` of the local shards, so its backward gets every gradient
  of the unit at once: written into one ``[W, S]`` buffer (the eager bucket's layout),
  reduce-scattered (plus the replica all-reduce on a 2-D mesh), divided as eagerly, and returned
  as each rank's shard, which autograd stores in the sharded ``.grad``.
* forward post-hook: the sharded parameters go back on the modules.
* ``reshard_after_forward`` becomes a partitioner choice: the gather runs under
  ``torch.utils.checkpoint`` with a recompute-all policy (backward all-gathers again; FULL_SHARD
  memory); with False the gathered parameters are saved (ZeRO-2).

So the compiled step issues the eager unit's collectives. What the eager path does through state
(accumulation without sync, CPU offload, custom collectives, reduction hooks, all-gather
extensions) is refused by ``refusal`` at trace time, one line naming the unit, the parameter or
setting and why: never a silent eager fallback inside a compiled step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .._compat import traced_collective
from ._layout import byte_columns

__all__ = ["refusal", "traced_pre_forward", "traced_post_forward", "top_is_traced"]


def top_is_traced(state: Any) -> bool:
    """Under a dynamo trace: whether ``state`` takes the traced path ([Note: the traced unit]):
    it is a top unit, or its top's forward is being traced (per-block compile keeps the eager
    hooks, which break the block's graph around them)."""
    top = state
    while top.parent is not None:
        top = top.parent
    return top is state or top.traced_forward


def refusal(state: Any) -> str | None:
    """Why the unit cannot run traced, as one line naming it and the parameter or setting, or None."""
    g = state.group
    if g is None:
        return None
    why = None
    if g.offload:
        why = "CPU offload (offload_policy=CPUOffloadPolicy) moves shards to the host outside the graph; drop it"
    elif any(g.extended):
        fqn = next(p.fqn for p, e in zip(g.params, g.extended) if e)
        why = f"'{fqn}' is a tensor subclass with fsdp_pre_all_gather, whose hooks run outside the graph"
    elif any(p.tp_mesh is not None for p in g.params):
        fqn = next(p.fqn for p in g.params if p.tp_mesh is not None)
        why = f"'{fqn}' is a tensor-parallel DTensor; FSDP x TP is not traced yet (compile the blocks instead)"
    elif not state.requires_gradient_sync or not state.requires_all_reduce:
        why = ("set_requires_gradient_sync(False) / set_requires_all_reduce(False) accumulate gradients outside "
               "the graph; compile the synchronised step only")
    elif g.comm.all_gather_comm is not None or g.comm.reduce_scatter_comm is not None:
        why = "a custom all-gather / reduce-scatter (set_custom_*) is not a traceable collective"
    elif g.comm.all_reduce_hook is not None or g.comm.force_sum:
        why = "set_all_reduce_hook / set_force_sum_reduction_for_comms run outside the graph"
    elif g.readopt_pending:
        why = "only some of its modules were moved; move the whole unit"
    return None if why is None else f"torch.compile of fully_shard({g.label}): {why}"


class _GatherUnit(torch.autograd.Function):
    """The unit's parameters, all-gathered from its flat buffer (forward), and the
    reduce-scattered gradients of its sharded local tensors (backward)."""

    @staticmethod
    def forward(ctx: Any, g: Any, src: torch.Tensor, *locals_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.g = g
        if not g.zero_copy:  # the eager all-gather input: each padded shard cast to param_dtype
            ends = [*g.ag_offsets[1:], g.ag_bytes]
            parts = []
            for p, o, e in zip(g.params, g.ag_offsets, ends):
                parts.append(p.padded.to(p.compute_dtype).view(torch.uint8))
                if e - o > parts[-1].numel():
                    parts.append(src.new_zeros(e - o - parts[-1].numel()))
            src = torch.cat(parts).to(g.compute_device)
        rows = (traced_collective("all_gather", src, g.shard_group) if g.world > 1 else src).view(g.world, -1)
        return tuple(_unpad(p.layout, byte_columns(rows, o, p.layout, p.compute_dtype))
                     for p, o in zip(g.params, g.ag_offsets))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        g = ctx.g
        W = g.world
        divisor = g.comm.gradient_divide_factor or W * g.replicate_world
        pos = {id(p): i for i, p in enumerate(g.params)}
        out: list[torch.Tensor | None] = [None] * len(g.params)
        for b in g.buckets:  # the eager unit's buckets: one reduce-scatter per reduce dtype
            send = torch.cat([_pad(p.layout, grads[pos[id(p)]], b.dtype, g.compute_device) for p in b.params], dim=1)
            red = traced_collective("reduce_scatter", send.view(-1), g.shard_group) if W > 1 else send.view(-1)
            red = red / divisor
            if g.replicate_group is not None:
                red = traced_collective("all_reduce", red, g.replicate_group)
            for p, o in zip(b.params, b.offsets):
                out[pos[id(p)]] = p.layout.local_view(red[o : o + p.layout.padded_numel], g.rank).to(p.orig_dtype)
        return (None, None, *out)


def _unpad(lay: Any, block: torch.Tensor) -> torch.Tensor:
    """The full tensor from the ``[W, padded_numel]`` rows of every rank (``ShardLayout.gather``
    as views): the ``W * c`` padded slices of dim ``d`` in rank order begin with its ``n`` real ones."""
    W, c, pre, row = block.shape[0], lay.chunk_rows, lay.pre_numel, lay.row_numel
    return block.reshape(W, pre, c, row).movedim(0, 1).reshape(pre, W * c, row)[:, : lay.rows].reshape(lay.shape)


def _pad(lay: Any, grad: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The inverse of `_unpad` (``ShardLayout.scatter`` of every rank): ``[W, padded_numel]`` in ``dtype``."""
    W, c, pre, row = lay.world, lay.chunk_rows, lay.pre_numel, lay.row_numel
    if grad is None:
        return torch.zeros(W, lay.padded_numel, dtype=dtype, device=device)
    g = torch.nn.functional.pad(grad.to(dtype).reshape(pre, lay.rows, row), (0, 0, 0, W * c - lay.rows))
    return g.reshape(pre, W, c, row).movedim(1, 0).reshape(W, lay.padded_numel)


def _gather(g: Any) -> tuple[torch.Tensor, ...]:
    return _GatherUnit.apply(g, g.sharded_bytes, *[p.sharded.to_local() for p in g.params])


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def traced_pre_forward(state: Any, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The traced forward pre-hook ([Note: the traced unit]): gather the unit once (at its first
    module) and put the gathered parameters on its modules."""
    if state.parent is None:
        state.traced_forward = True
    g = state.group
    if g is not None and not state.traced_live:
        why = refusal(state)
        if why is not None:
            raise RuntimeError(why)
        raf = state.user_reshard_after_forward
        if raf is None:
            raf = state.parent is not None  # the top keeps its parameters, as the eager root
        if raf is not False and torch.is_grad_enabled():
            fulls = checkpoint(_gather, g, use_reentrant=False,
                               context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all))
        else:
            fulls = _gather(g)
        for p, f in zip(g.params, fulls):
            for m, name in p.uses:
                m._parameters[name] = f
        state.traced_live = True
    return state._cast_inputs(args, kwargs)


def traced_post_forward(state: Any, module: Any, args: Any, output: Any) -> Any:
    """The traced forward post-hook: the sharded parameters back on the modules once the last
    of the unit's modules ran."""
    state.traced_seen += 1
    if state.traced_seen >= len(state.modules):
        state.traced_seen = 0
        if state.group is not None:
            for p in state.group.params:
                p.register(unsharded=False)
        state.traced_live = False
        if state.parent is None:
            state.traced_forward = False
    return state._cast_output(output)
