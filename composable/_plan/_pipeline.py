"""Memory plan of a pipelined model: `plan_memory` per stage (pure, shapes only).

[Note: the memory of a pipeline stage]
Each stage is planned as a model of its own with `plan_memory` (its blocks as units, the
embedding / head in the stage's root unit) on the stage's ``(dp_replicate, dp_shard, tp)`` mesh.
Activations: ``activation_bytes`` is the peak of one forward + loss of the whole model on one
data-parallel rank's batch (as for `plan_memory`); a stage holds its share of the blocks
(``blocks_in_stage / blocks``) for the microbatches alive at once, each ``1 / m`` of the batch:
``m`` of them under GPipe, ``min(pp - s, m)`` on stage ``s`` under 1F1B (the first stage holds
the most), about ``pp + (v - 1) * pp / v`` per rank interleaved. Stage boundaries are those of
the automatic split by parameter bytes unless given. Parameters: `PipelineSchedule` keeps a
unit's parameters gathered from its stage's first forward to its last backward unless
``reshard_between_microbatches=True`` or the unit set ``reshard_after_forward`` itself
([Note: fully_shard units in a pipeline step]), so by default a stage is planned with
``reshard_after_forward=False`` (its blocks' gathered parameters all count at the peak, as with
``SHARD_GRAD_OP``). Gradients: with ``m > 1`` microbatches (and not ``reduce_every_microbatch``)
every unit keeps its unsharded gradient from its first backward of the step to its last, summed
in the reduce dtype when the parameters compute in a lower one
([Note: accumulating in the reduce dtype]): ``accumulated_grads`` adds those not already in ``grad_buffers`` /
``root_grads`` (the largest unit's and the root's), and the extra bytes of those two in the
wider dtype. Not modelled: the activation buffers in flight between stages, the embedding's and
head's activations beyond that share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn

from .._pipeline._stages import plan_stages
from .._wrap import ShardingPolicy
from ._units import declares_units, fmt_bytes, plan_units

__all__ = ["PipelineMemoryPlan", "plan_pipeline_memory"]


@dataclass(frozen=True)
class PipelineMemoryPlan:
    """``stages[s]``: the `MemoryPlan` of stage ``s``; ``bounds``: its blocks; ``peak``: the
    largest stage peak (what each GPU must hold)."""

    pp: int
    schedule: str
    microbatches: int
    bounds: tuple[int, ...]
    stages: tuple

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.stages)

    @property
    def worst_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].peak)

    def __str__(self) -> str:
        lines = [f"pipeline pp={self.pp}, {self.schedule}, {self.microbatches} microbatches; peak per GPU "
                 f"{fmt_bytes(self.peak)} (stage {self.worst_stage})"]
        for s, p in enumerate(self.stages):
            lines.append(f"  stage {s} blocks {self.bounds[s]}..{self.bounds[s + 1] - 1}: peak {fmt_bytes(p.peak)} "
                         f"(params {fmt_bytes(p.params)}, activations {fmt_bytes(p.activations)})")
        return "\n".join(lines)


class _StageView(nn.Module):
    """A stage as a module: the pre/post-modules it holds and its blocks, for `plan_memory`."""


def _in_flight(schedule: str, pp: int, m: int, s: int) -> float:
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - s, m)
    return min(pp + (pp - 1) / 2, m)  # interleaved, v = 2: a little more than 1F1B's first stage


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


def plan_pipeline_memory(model: nn.Module, pp: int, mesh_shape, policy, *, microbatches: int = 1,
                         schedule: str = "1f1b", stage_bounds=None, layers: str | None = None,
                         activation_bytes: int = 0, reshard_between_microbatches: bool = False,
                         reduce_every_microbatch: bool = False, **kwargs) -> PipelineMemoryPlan:
    """Plan each of the ``pp`` stages of ``model`` with `plan_memory`; see
    [Note: the memory of a pipeline stage]. ``kwargs`` go to `plan_memory`."""
    if schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        raise ValueError(f"plan_memory: schedule={schedule!r}; choose gpipe, 1f1b or interleaved_1f1b")
    if microbatches < 1:
        raise ValueError(f"plan_memory: microbatches={microbatches}; it must be >= 1")
    plan, path, names, pre, post = plan_stages(model, pp, layers=layers, cost="params", split_points=stage_bounds)
    blocks = list(path[-1]._modules[names[-1]])
    if not isinstance(policy, ShardingPolicy):
        policy = ShardingPolicy(policy, no_split_modules=declares_units(model))
    if not reshard_between_microbatches and policy.reshard_after_forward is None:
        policy = replace(policy, reshard_after_forward=False)  # gathered for the whole step
    classes = sorted({c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or [])})
    stages = []
    for s in range(pp):
        view = _StageView()
        view._no_split_modules = classes
        if s == 0:
            for d, n in pre:
                view.add_module(f"pre_{d}_{n}", path[d]._modules[n])
        holder = nn.Module()
        for i in plan.blocks(s):
            holder.add_module(str(i), blocks[i])
        view.add_module("layers", holder)
        if s == pp - 1:
            for d, n in post:
                view.add_module(f"post_{d}_{n}", path[d]._modules[n])
        share = len(plan.blocks(s)) / len(blocks)
        act = activation_bytes * share * _in_flight(schedule, pp, microbatches, s) / microbatches
        stage = plan_units(view, mesh_shape, policy, activation_bytes=int(act), **kwargs)
        if microbatches > 1 and not reduce_every_microbatch:
            stage = replace(stage, accumulated_grads=_accumulated(stage, kwargs.get("mp_policy")))
        stages.append(stage)
    return PipelineMemoryPlan(pp, schedule, microbatches, plan.bounds, tuple(stages))
