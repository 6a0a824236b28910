"""The memory of one model (or one pipeline stage) under ``fully_shard``, from shapes alone:
`plan_units`, the core `plan_memory` calls for ``pp == 1`` and once per stage for a pipeline.
See [Note: the memory model] in ``_planner.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from shardwise.mesh import byte_layout

from .._fsdp import MixedPrecisionPolicy, make_layout
from .._wrap import ShardingPolicy, ShardingStrategy, select_units
from ._options import PlanOptions

__all__ = ["UnitPlan", "MemoryPlan", "plan_units", "fmt_bytes", "declares_units"]


@dataclass(frozen=True)
class UnitPlan:
    """One unit (``name`` "" is the root); bytes per rank unless noted. ``unsharded``: gathered,
    TP-local, in ``param_dtype``; ``reduce_bytes``: its padded reduce-scatter input."""

    name: str
    numel: int
    sharded: int
    trainable: int  # elements
    trainable_bytes: int
    unsharded: int
    unsharded_grads: int
    reduce_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes per rank; see [Note: the memory model] in ``_planner.py``."""

    mesh_shape: tuple[int, int, int]  # (dp_replicate, dp_shard, tp)
    strategy: str
    units: tuple[UnitPlan, ...]
    params: int
    grads: int
    optimizer: int
    unsharded_forward: int
    unsharded_backward: int
    root_grads: int
    grad_buffers: int
    activations: int
    accumulated_grads: int = 0  # a pipeline stage's other units' gradients summed over microbatches
    cp: int = 1  # context-parallel ranks: parameters sharded over dp_shard x cp, activations / cp
    held_grads: int = 0  # a pipeline stage's gradients held at once in a later backward, beyond those above

    @property
    def between_steps(self) -> int:  # gradients freed by zero_grad(set_to_none=True)
        return self.params + self.optimizer

    @property
    def start_of_backward(self) -> int:
        return (self.between_steps + self.unsharded_forward + self.activations + self.root_grads
                + self.accumulated_grads + self.held_grads)

    @property
    def end_of_backward(self) -> int:
        return self.between_steps + self.grads + self.unsharded_backward + self.grad_buffers + self.accumulated_grads

    @property
    def peak(self) -> int:
        return max(self.start_of_backward, self.end_of_backward)

    @property
    def upper_bound(self) -> int:
        return self.end_of_backward + self.activations

    def __str__(self) -> str:
        (R, S, T), big = self.mesh_shape, max(self.units, key=lambda u: u.unsharded)
        keys = ("params", "optimizer", "grads", "unsharded_forward", "unsharded_backward", "root_grads",
                "grad_buffers", "accumulated_grads", "held_grads", "activations", "start_of_backward", "end_of_backward", "peak")
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return "\n".join([f"{self.strategy}, dp_replicate={R} x dp_shard={S}{cp} x tp={T}: {len(self.units)} units, "
                          f"{sum(u.numel for u in self.units):,} params; largest '{big.name or '(root)'}' "
                          f"{fmt_bytes(big.unsharded)} gathered. Per rank:"]
                         + [f"  {k:18s} {fmt_bytes(getattr(self, k)):>11s}" for k in keys])


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 / 10 else f"{b / 2**20:.1f} MiB"


def declares_units(model: nn.Module) -> bool:
    return any(getattr(m, "_no_split_modules", None) for m in model.modules())


def _mesh_shape(shape, strategy: ShardingStrategy, cp: int = 1) -> tuple[int, int, int]:
    t = (shape,) if isinstance(shape, int) else tuple(shape)
    full = {1: (1, *t, 1), 2: (*t, 1), 3: t}.get(len(t))
    if full is None or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in full):
        raise ValueError(f"mesh_shape={shape!r}: give dp_shard, (dp_replicate, dp_shard) or "
                         "(dp_replicate, dp_shard, tp), each an int >= 1")
    R, S, _ = full
    problem = strategy.spec.mesh_problem(R, S * cp)  # the one rule, in the strategy table (shards: dp_shard x cp)
    if problem is not None:
        raise ValueError(f"plan_memory: mesh_shape {tuple(full)}: {problem}")
    return full


def _unit(name: str, params: list, shard: int, tp: int, mp: MixedPrecisionPolicy) -> UnitPlan:
    align = max((p.dtype.itemsize for p in params), default=1)  # fully_shard's byte alignment
    cols, padded_bytes = [], []
    for p in params:
        rows = -(-p.shape[0] // tp) if tp > 1 and p.dim() >= 2 else p.shape[0]
        row, g, size = math.prod(p.shape[1:]), p.requires_grad, p.dtype.itemsize
        padded = make_layout((rows, *p.shape[1:]), shard).padded_numel  # fully_shard's own layout
        full, compute = rows * row, (mp.param_dtype or p.dtype).itemsize
        reduce = (mp.reduce_dtype or mp.param_dtype or p.dtype).itemsize
        padded_bytes.append(padded * size)
        cols.append((p.numel(), g * padded, g * padded * size, full * compute, g * full * compute,
                     g * padded * shard * reduce))
    numel, *rest = [sum(c) for c in zip(*cols)] or [0] * 6
    return UnitPlan(name, numel, byte_layout(padded_bytes, align)[1], *rest)


def plan_units(model: nn.Module, mesh_shape: int | tuple[int, ...], options: PlanOptions) -> MemoryPlan:
    """`plan_memory` of one model without a pipeline (``options.pp`` etc. unused)."""
    policy, cp, prefetch = options.policy, options.cp, options.prefetch
    if not isinstance(policy, ShardingPolicy):
        policy = ShardingPolicy(policy, no_split_modules=declares_units(model))
    strategy = ShardingStrategy(policy.strategy)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"plan_memory: cp={cp!r} must be an int >= 1 (context-parallel ranks)")
    R, S, T = _mesh_shape(mesh_shape, strategy, cp)
    if not isinstance(prefetch, int) or prefetch < 1 or options.optimizer_states < 0:
        raise ValueError(f"plan_memory: prefetch={prefetch!r} must be an int >= 1, optimizer_states >= 0")
    shard = 1 if strategy.replicates_all else S * cp  # [Note: context parallelism in the plan] in _planner.py
    mp, modules = options.mp_policy or MixedPrecisionPolicy(), dict(model.named_modules())
    names = list(options.units) if options.units is not None else select_units(model, policy)
    missing = [n for n in names if n not in modules or n == ""]
    if missing:
        raise ValueError(f"plan_memory: units {missing} are not submodules of {type(model).__name__} "
                         f"(qualified names such as {list(modules)[1:4]})")
    seen: set[int] = set()
    plans: list[UnitPlan] = []
    for name in names + [""]:
        own = [p for p in modules[name].parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own or name == "":
            plans.append(_unit(name, own, shard, T, mp))
    root, others = plans[-1], plans[:-1]
    raf = strategy.reshard_after_forward if policy.reshard_after_forward is None else policy.reshard_after_forward
    alias = shard == 1 and mp.param_dtype is None  # [Note: a shard of one rank] in _sharded_param.py
    ahead, every = sum(sorted((u.unsharded for u in others), reverse=True)[:prefetch]), sum(u.unsharded for u in others)
    kept = 0 if raf is True else every if raf in (False, 1) else every // raf
    extra = ahead if raf is True or raf not in (False, 1) else 0  # units gathered while computing
    fwd, bwd = (0, 0) if alias else (root.unsharded + kept, root.unsharded + kept + extra)
    largest = max(others, key=lambda u: u.unsharded, default=root)
    grad_buffers = largest.unsharded_grads + largest.reduce_bytes + (root.unsharded_grads if largest is not root else 0)
    grads = sum(u.trainable_bytes for u in plans)
    dtype = options.optimizer_dtype
    per_state = grads if dtype is None else sum(u.trainable for u in plans) * dtype.itemsize
    return MemoryPlan((R, S, T), strategy.value, tuple(plans), sum(u.sharded for u in plans), grads,
                      options.optimizer_states * per_state, fwd, bwd, root.unsharded_grads, grad_buffers,
                      -(-int(options.activation_bytes) // cp), cp=cp)
