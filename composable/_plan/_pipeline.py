"""Memory plan of a pipelined model: `plan_memory` per stage (pure, shapes only).

[Note: the memory of a pipeline stage]
Each stage is planned with `plan_memory` as a model of its own (its blocks as units, embedding /
head in its root unit) on the stage's ``(dp_replicate, dp_shard, tp)`` mesh; rank ``r`` holds
its stages by the schedule's placement. Boundaries are the automatic split by parameter bytes
unless given.

Activations. ``activation_bytes = A`` is the peak of one forward + loss of the whole model on one
data-parallel rank's batch. Given ``tokens``, the ends are estimated from shapes (`end_terms` in
``_stage_terms.py``, compute dtype, ``/ tp``): with the head ``D -> V`` (the last ``nn.Linear``
after the blocks) the head and loss keep ``H_k = tokens (V + 2D)`` elements and hold ``H_t =
tokens V`` more for one microbatch at a time; the embedding (width ``E``) outputs ``E_b = tokens
E``. Each block gets ``b = max(A - H_k - H_t - E_b, 0) / blocks``. A microbatch alive on virtual
stage ``k`` weighs

    w_k = (b * blocks_k + E_b [k = 0] + H_k [k = last]) / m    bytes

and a rank's activations are the peak of the walk of its action list with these weights
(`walk_in_flight`, [Note: activations in flight] in ``_pipeline/_schedules/_in_flight.py``), plus
``H_t / m`` on the head's rank. Without ``tokens`` the ends count as blocks. A schedule with a
split backward also keeps, from each ``I`` to its ``W``, ``kept_grads * w_k`` per microbatch on a
stage ``k > 0``; None means `DEFAULT_KEPT_GRADS` (0.62, the largest ratio measured on the example
Llama; `PipelineSchedule.last_kept_grad_bytes` measures it) for such a schedule, else 0.

Parameters: a stage is planned with ``reshard_after_forward=False`` ([Note: fully_shard units in
a pipeline step]). Gradients with ``m > 1``: every unit keeps its unsharded gradient from its
first backward to its last (in the reduce dtype: [Note: accumulating in the reduce dtype]), as
``accumulated_grads`` beyond ``grad_buffers`` / ``root_grads``. From a rank's first backward on,
``held_grads`` adds the largest unit's sum and the new gradients before they are added (the
largest unit's in a full backward, all of the rank's in a split backward's ``W`` on a stage
``> 0``). So the start of backward is the larger of before the first backward and from it on
(`before_and_after_first_backward`): GPipe peaks at the first, 1F1B and zb_h1 at the second.
With virtual stages every unit is taken to hold gradients from the first backward (an upper bound).

Measured (``benchmarks/plan_check_pp.py``, ``pp=2 x dp_shard=2``, ``tokens`` given): GPipe, 1F1B
and zb_h1 stages within -6.3 % to +7.1 % of their peaks. Not modelled: activations in flight
between stages, other heads or losses, allocator caching.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch.nn as nn

from .._pipeline import ActionKind, activations_in_flight, build_schedule, get_schedule, plan_stages, stage_rank
from .._wrap import ShardingPolicy
from ._options import PlanOptions, with_overrides
from ._stage_terms import before_and_after_first_backward, end_terms, held_grads
from ._units import MemoryPlan, declares_units, fmt_bytes, plan_units

__all__ = ["DEFAULT_KEPT_GRADS", "PipelineMemoryPlan", "plan_pipeline_memory", "splits_backward"]

DEFAULT_KEPT_GRADS = 0.62
"""``kept_grads`` planned for a schedule with a split backward when none is given: the largest of
the ratios measured on the example Llama's stages (0.36-0.62; ``benchmarks/pipeline_zb.py --parts
memory``), see [Note: the memory of a pipeline stage]."""


@dataclass(frozen=True, kw_only=True)
class PipelineMemoryPlan(MemoryPlan):
    """A `MemoryPlan` whose figures are the worst pp rank's, with ``stages[r]`` (pp rank ``r``'s
    plan), ``bounds`` (the blocks of every stage), ``in_flight[r]`` (microbatch-units of
    activations at ``r``'s peak) and the head's / embedding's planned activations."""

    pp: int
    schedule: str
    microbatches: int
    bounds: tuple[int, ...]
    stages: tuple[MemoryPlan, ...]
    virtual_stages: int = 1
    in_flight: tuple[float, ...] = ()
    kept_grads: float = 0.0
    head_activations: int = 0  # the head's + loss's share of activation_bytes (estimated from ``tokens``)
    embedding_activations: int = 0  # the embedding's share

    @property
    def worst_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].peak)

    def __str__(self) -> str:
        kept = f", kept gradients {self.kept_grads:g} per microbatch-unit" if self.kept_grads else ""
        if self.head_activations or self.embedding_activations:
            kept += (f"; of the activations, head + loss {fmt_bytes(self.head_activations)}, embedding "
                     f"{fmt_bytes(self.embedding_activations)}")
        lines = [f"pipeline pp={self.pp}, {self.schedule}, {self.microbatches} microbatches{kept}; peak per GPU "
                 f"{fmt_bytes(self.peak)} (stage {self.worst_stage})"]
        for s, p in enumerate(self.stages):
            blocks = ", ".join(f"{self.bounds[k]}..{self.bounds[k + 1] - 1}"
                               for k in range(s, len(self.bounds) - 1, self.pp))
            lines.append(f"  stage {s} blocks {blocks}: peak {fmt_bytes(p.peak)} "
                         f"(params {fmt_bytes(p.params)}, activations {fmt_bytes(p.activations)})")
        return "\n".join(lines)


class _StageView(nn.Module):
    """A stage as a module: the pre/post-modules it holds and its blocks, for `plan_memory`."""

    _no_split_modules: list[str] = []


def _accumulated(plan, mp) -> int:
    """Bytes of the unsharded gradients a stage sums over microbatches beyond what ``plan``
    counts already; see [Note: the memory of a pipeline stage]."""
    compute = mp.param_dtype if mp is not None else None
    reduce = mp.reduce_dtype if mp is not None else None
    widen = reduce.itemsize / compute.itemsize if compute and reduce and reduce.itemsize > compute.itemsize else 1
    root, others = plan.units[-1], plan.units[:-1]
    largest = max(others, key=lambda u: u.unsharded, default=root)
    counted = root.unsharded_grads + (largest.unsharded_grads if largest is not root else 0)
    total = sum(u.unsharded_grads for u in plan.units)
    return int((total - counted) * widen + counted * (widen - 1))


def plan_pipeline_memory(model: nn.Module, mesh_shape: int | tuple[int, ...], options: PlanOptions | None = None,
                         **overrides: Any) -> PipelineMemoryPlan:
    """Plan each of the ``options.pp`` ranks of ``model`` as `plan_memory` plans a model, on the
    stage mesh ``mesh_shape``; see [Note: the memory of a pipeline stage]. Keywords are fields of
    `PlanOptions` and override ``options``. `plan_memory` returns the same for ``pp > 1``; this
    entry point's type says so (and it plans ``pp = 1`` as a one-stage pipeline)."""
    o = with_overrides(options or PlanOptions(), overrides, "plan_pipeline_memory")
    pp, microbatches, kept_grads, policy = o.pp, o.microbatches, o.kept_grads, o.policy
    spec = get_schedule(o.schedule)
    if microbatches < 1:
        raise ValueError(f"plan_memory: microbatches={microbatches}; it must be >= 1")
    v = (2 if spec.virtual else 1) if o.virtual_stages is None else o.virtual_stages
    spec.check(pp, microbatches, v)
    if kept_grads is None:
        kept_grads = DEFAULT_KEPT_GRADS if splits_backward(spec, pp, microbatches, v) else 0.0
    elif isinstance(kept_grads, bool) or not isinstance(kept_grads, (int, float)) or not kept_grads >= 0:
        raise ValueError(f"plan_memory: kept_grads={kept_grads!r}; it is a size ratio >= 0 (kept gradient bytes "
                         "per microbatch over activation bytes per microbatch), or None for the default")
    plan, path, names, pre, post = plan_stages(model, pp * v, cost="params", split_points=o.stage_bounds)
    blocks = list(path[-1]._modules[names[-1]])
    sizes = [len(plan.blocks(k)) for k in range(pp * v)]
    where = [stage_rank(k, pp, spec.placement) for k in range(pp * v)]
    on_rank = [sum(sz for sz, r in zip(sizes, where) if r == rank) for rank in range(pp)]
    alive = activations_in_flight(spec, pp, microbatches, v, [sizes[k] / on_rank[where[k]] for k in range(pp * v)],
                                  kept_grads=float(kept_grads))
    mp = o.mp_policy
    ends = end_terms([path[d]._modules[n] for d, n in pre], [path[d]._modules[n] for d, n in post], o.tokens,
                     mp.param_dtype if mp is not None else None, _tp(mesh_shape))
    per_block = max(o.activation_bytes - ends.total, 0) / len(blocks)  # one block's share of the whole batch
    weight = [(per_block * sizes[k] + ends.embedding * (k == 0) + ends.head_kept * (k == pp * v - 1)) / microbatches
              for k in range(pp * v)]  # bytes per microbatch alive on virtual stage k
    acts = build_schedule(spec, pp, microbatches, v)
    if not isinstance(policy, ShardingPolicy):
        policy = ShardingPolicy(policy, no_split_modules=declares_units(model))
    if not o.reshard_between_microbatches and policy.reshard_after_forward is None:
        policy = replace(policy, reshard_after_forward=False)  # gathered for the whole step
    classes = sorted({c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or [])})
    stages: list[MemoryPlan] = []
    for s in range(pp):
        view = _StageView()
        view._no_split_modules = classes
        if where[0] == s:
            for d, n in pre:
                view.add_module(f"pre_{d}_{n}", path[d]._modules[n])
        holder = nn.Module()
        for k in (k for k in range(pp * v) if where[k] == s):
            for i in plan.blocks(k):
                holder.add_module(str(i), blocks[i])
        view.add_module("layers", holder)
        if where[-1] == s:
            for d, n in post:
                view.add_module(f"post_{d}_{n}", path[d]._modules[n])
        transient = ends.head_transient / microbatches if where[-1] == s else 0.0
        before, after = before_and_after_first_backward(acts[s], {k: weight[k] for k in range(pp * v) if where[k] == s},
                                                        float(kept_grads))
        acts_bytes = int(max(before, after) + transient)
        stage = plan_units(view, mesh_shape, replace(o, policy=policy, activation_bytes=acts_bytes))
        if microbatches > 1 and not o.reduce_every_microbatch:
            stage = replace(stage, accumulated_grads=_accumulated(stage, mp))
            later = replace(stage, activations=-(-int(after + transient) // stage.cp), held_grads=held_grads(stage))
            first = replace(stage, activations=-(-int(before + transient) // stage.cp))
            stage = max(first, later, key=lambda p: p.start_of_backward)  # before / from the first backward
        stages.append(stage)
    worst = max(stages, key=lambda p: p.peak)
    return PipelineMemoryPlan(**{f.name: getattr(worst, f.name) for f in fields(MemoryPlan)}, pp=pp,
                              schedule=spec.name, microbatches=microbatches, bounds=plan.bounds, stages=tuple(stages),
                              virtual_stages=v, in_flight=alive.per_rank, kept_grads=float(kept_grads),
                              head_activations=ends.head_kept + ends.head_transient,
                              embedding_activations=ends.embedding)


def _tp(mesh_shape) -> int:
    t = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    return t[2] if len(t) == 3 and isinstance(t[2], int) and t[2] >= 1 else 1


def splits_backward(schedule, pp: int, microbatches: int, virtual_stages: int = 1) -> bool:
    """Whether ``schedule``'s action lists at these sizes split any backward into ``I`` and ``W``."""
    spec = get_schedule(schedule)
    return any(a.kind is ActionKind.I for acts in spec.actions(pp, microbatches, virtual_stages) for a in acts)
