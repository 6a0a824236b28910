"""Per-rank memory of a ``fully_shard`` layout from shapes alone, and a mesh for a cluster.

    with torch.device("meta"):
        model = Llama(cfg)                                    # no memory, no devices
    print(plan_memory(model, (1, 64, 1), "FULL_SHARD"))      # (dp_replicate, dp_shard, tp)

[Note: the memory model]
Units are those of ``apply_fully_shard`` (`select_units`); the root takes every other parameter.
With ``S`` ranks on the shard axis (1 for NO_SHARD) a parameter of TP-local shape ``(n, *rest)``
takes ``ceil(n / S)`` rows per rank (``fully_shard``'s padded slot). Per rank:

    params, optimizer   sharded parameters (own dtype) and ``optimizer_states`` tensors like each
                        trainable shard (AdamW: 2)
    grads               sharded gradients of the trainable parameters
    unsharded_forward   gathered parameters (``param_dtype``) kept into backward: the root's, plus
                        every unit's (SHARD_GRAD_OP, NO_SHARD) or ``1/k`` of them (``reshard_after_forward=k``)
    unsharded_backward  that, plus ``prefetch`` times the largest other unit when units reshard
    root_grads          the root's unsharded gradients (it reduces last)
    grad_buffers        root_grads + the largest unit's unsharded gradients and reduce-scatter input
    activations         as given (``benchmarks/plan_check.py`` measures them)

Backward frees activations unit by unit while sharded gradients grow, so the peak is at an end:

    start of backward   params + optimizer + unsharded_forward + activations + root_grads
    end of backward     params + optimizer + grads + unsharded_backward + grad_buffers
    peak = max(start, end); upper_bound = everything at once

(``root_grads`` at the start stands for backward's first gradient, the logits' ``tokens x
vocab``.) A one-rank shard axis without a cast gathers nothing. TP is approximated: 2+-D
parameters split ``ceil(n / tp)`` on dim 0, 1-D ones replicate. Not modelled: AdamW's ``step``
tensors, buffers, allocator caching, communication buffers, CPU offload.

[Note: context parallelism in the plan]
With ``cp > 1`` the shard axis is ``dp_shard x cp`` (`data_parallel_mesh`), so every sharded term
uses ``S * cp``, and ``activation_bytes`` (given as at ``cp = 1``) is divided by ``cp``: every
activation of a block is per token (the fused kernel holds no ``T x T`` matrix). Not modelled: the
ring's key/value block in flight, its float32 gradient accumulators, the cp communication.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from .._wrap import ShardingPolicy, ShardingStrategy
from ._options import MeshOptions, PlanOptions, with_overrides
from ._pipeline import plan_pipeline_memory
from ._units import MemoryPlan, declares_units, fmt_bytes, plan_units

__all__ = ["plan_memory", "MeshSuggestion", "suggest_mesh"]


def plan_memory(model: nn.Module, mesh_shape: int | tuple[int, ...],
                options: PlanOptions | ShardingPolicy | ShardingStrategy | str | None = None,
                **overrides: Any) -> MemoryPlan:
    """Estimate the bytes per rank of ``model`` under ``fully_shard``, from shapes alone (meta
    device fine) ([Note: the memory model]).

    ``mesh_shape``: ``dp_shard``, ``(dp_replicate, dp_shard)`` or ``(dp_replicate, dp_shard, tp)``
    (one stage's with ``pp > 1``). ``options``: a `PlanOptions` or its ``policy``; keywords are its
    fields and override it. With ``pp > 1`` the result is a `PipelineMemoryPlan` (the worst
    rank's figures, every rank's in ``.stages``; [Note: the memory of a pipeline stage] in
    ``_plan/_pipeline.py``). Raises ValueError for a mesh shape the strategy cannot use or unknown
    unit names, TypeError for an unknown keyword.
    """
    base = options if isinstance(options, PlanOptions) else PlanOptions() if options is None else PlanOptions(options)
    o = with_overrides(base, overrides, "plan_memory")
    return plan_units(model, mesh_shape, o) if o.pp == 1 else plan_pipeline_memory(model, mesh_shape, o)


@dataclass(frozen=True)
class MeshSuggestion:
    """The chosen mesh and strategy, its `MemoryPlan`, the estimated communication per step and rank
    (``comm_seconds``, ``cross_host_bytes``) and the ``reasoning`` (``str()`` prints it)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    strategy: str
    plan: MemoryPlan
    comm_seconds: float
    cross_host_bytes: float
    reasoning: tuple[str, ...]
    pp: int = 1  # pipeline stages; with pp > 1, ``plan`` is the worst stage's and the mesh is per stage
    cp: int = 1  # context-parallel ranks (between dp_shard and tp)

    def __str__(self) -> str:
        return "\n".join(self.reasoning)


def _ring(n: int, size: float, all_reduce: bool = False) -> float:
    return 0.0 if n <= 1 else (2 if all_reduce else 1) * (n - 1) / n * size


def _comm(plan: MemoryPlan, gpus_per_host: int, hosts: int, intra: float, inter: float,
          gather_once: bool = False) -> tuple[float, float]:
    """(seconds, cross-host bytes) of one rank's data-parallel sends per step (ring algorithms).
    ``gather_once``: every unit all-gathers once per step (a pipeline stage keeps its parameters
    gathered for the step, [Note: fully_shard units in a pipeline step])."""
    (R, S, T), strategy = plan.mesh_shape, ShardingStrategy(plan.strategy)
    S *= plan.cp  # the shard axis is dp_shard x cp: S * cp * T consecutive ranks
    shard, rep = (1, R * S) if strategy.replicates_all else (S, R)
    others = sum(u.unsharded for u in plan.units[:-1])  # gathered again in backward when resharded
    gathered = others * (1 + (strategy.reshard_after_forward and not gather_once)) + plan.units[-1].unsharded
    reduced = sum(u.reduce_bytes for u in plan.units)
    shard_bytes, rep_bytes = _ring(shard, gathered) + _ring(shard, reduced), _ring(rep, reduced / shard, True)
    shard_cross, rep_cross = hosts > 1 and (shard * T > gpus_per_host or gpus_per_host % (shard * T)), hosts > 1
    return (shard_bytes / (inter if shard_cross else intra) + rep_bytes / (inter if rep_cross else intra),
            shard_bytes * shard_cross + rep_bytes * rep_cross)


def suggest_mesh(model: nn.Module, hosts: int, gpus_per_host: int, bytes_per_gpu: int,
                 options: MeshOptions | None = None, **overrides: Any) -> MeshSuggestion:
    """The mesh ``(dp_replicate, dp_shard, tp)`` and strategy that fit ``bytes_per_gpu`` with the
    least estimated data-parallel communication time. ``options``: a `MeshOptions`; keywords are
    its fields and override it (docs/planner.md).

    Candidates: every ``tp`` dividing ``gpus_per_host``, every split of the other ranks into
    ``dp_replicate x dp_shard``, with and without resharding after forward, each planned by
    `plan_memory`; one fits when ``peak <= headroom * bytes_per_gpu``. The smallest fitting
    model-parallel degree wins (``pp``, each dividing ``hosts``, first; then ``cp x tp``, at equal
    degree the smaller ``tp``; ``activation_bytes`` divided by both, [Note: context parallelism in
    the plan]); among its candidates the least ring time at ``intra_host_bandwidth`` /
    ``inter_host_bandwidth`` (within 1 %: less memory). Raises ValueError naming the smallest
    candidate when nothing fits.
    """
    o = with_overrides(options or MeshOptions(), overrides, "suggest_mesh")
    pp_sizes, cp_sizes, headroom = o.pp_sizes, o.cp_sizes, o.headroom
    if min(hosts, gpus_per_host) < 1 or bytes_per_gpu <= 0:
        raise ValueError("suggest_mesh: hosts, gpus_per_host and bytes_per_gpu must be positive")
    base = o.policy or ShardingPolicy(no_split_modules=declares_units(model))
    world, budget = hosts * gpus_per_host, headroom * bytes_per_gpu
    bad_pp = [p for p in pp_sizes if not isinstance(p, int) or p < 1 or hosts % p]
    if bad_pp:
        raise ValueError(f"suggest_mesh: pp_sizes {bad_pp} must divide hosts={hosts} (whole hosts per stage)")
    bad_cp = [c for c in cp_sizes if isinstance(c, bool) or not isinstance(c, int) or c < 1 or gpus_per_host % c]
    if bad_cp or not cp_sizes:
        raise ValueError(f"suggest_mesh: cp_sizes {list(cp_sizes)} must be ints dividing gpus_per_host={gpus_per_host} "
                         "(the cp ring stays in a host)")
    by_pp: dict[int, list] = {}
    for pp in sorted(set(pp_sizes)):
        sw_ = world // pp  # ranks per stage
        shapes = [(sw_ // (tp * cp) // S, S, cp, tp) for cp in sorted(set(cp_sizes))
                  for tp in range(1, gpus_per_host // cp + 1) if gpus_per_host % (tp * cp) == 0
                  for S in range(1, sw_ // (tp * cp) + 1) if sw_ // (tp * cp) % S == 0]
        for R, S, cp, tp in shapes:
            for name in (["NO_SHARD"] if S * cp == 1 else ["SHARD_GRAD_OP", "FULL_SHARD"] if R == 1
                         else ["HYBRID_SHARD_ZERO2", "HYBRID_SHARD"]):
                pol = replace(base, strategy=name, reshard_after_forward=None)
                po = PlanOptions(pol, mp_policy=o.mp_policy, optimizer_states=o.optimizer_states,
                                 activation_bytes=o.activation_bytes // tp, pp=pp, microbatches=o.microbatches,
                                 schedule=o.schedule, cp=cp, kept_grads=o.kept_grads, tokens=o.tokens)
                if pp == 1:
                    plan = plan_units(model, (R, S, tp), po)
                else:  # the worst stage's own plan
                    plan = (pipe := plan_pipeline_memory(model, (R, S, tp), po)).stages[pipe.worst_stage]
                secs, cross = _comm(plan, gpus_per_host, hosts // pp, o.intra_host_bandwidth, o.inter_host_bandwidth,
                                    gather_once=pp > 1)
                by_pp.setdefault(pp, []).append(((tp * cp, tp), secs, plan.peak, plan, cross))
    pp = next((p for p in sorted(by_pp) if any(c[2] <= budget for c in by_pp[p])), min(by_pp))
    candidates = by_pp[pp]
    fitting = [c for c in candidates if c[2] <= budget]
    lines = [f"world {world} = {hosts} host(s) x {gpus_per_host} GPUs; budget {fmt_bytes(budget)} per GPU "
             f"({headroom:.0%} of {fmt_bytes(bytes_per_gpu)}); bandwidth per GPU {o.intra_host_bandwidth / 1e9:g} GB/s "
             f"in a host, {o.inter_host_bandwidth / 1e9:g} GB/s across hosts"]
    shown = min((c[0] for c in fitting), default=(gpus_per_host, gpus_per_host))  # up to the smallest that fits
    for deg, secs, peak, plan, cross in sorted((c for c in candidates if c[0] <= shown), key=lambda c: c[:3]):
        (R, S, tp), cp_text = plan.mesh_shape, (f" cp={plan.cp}" if plan.cp > 1 else "")
        lines.append(f"  tp={tp}{cp_text} {plan.strategy:18s} ({R} x {S}): peak {fmt_bytes(peak):>11s} "
                     f"{'fits' if peak <= budget else 'too big'}; comm {secs * 1e3:8.1f} ms/step, "
                     f"{fmt_bytes(cross)} across hosts")
    if not fitting:
        best = min(candidates, key=lambda c: c[2])[3]
        raise ValueError("\n".join(lines + [f"suggest_mesh: nothing fits; the smallest is {best.strategy} "
                                             f"{best.mesh_shape} at {fmt_bytes(best.peak)}. Add hosts, use bf16 params "
                                             "(mp_policy), activation checkpointing, or a smaller micro-batch."]))
    deg, fastest = min((c[0], c[1]) for c in fitting)  # least time at the smallest degree; within 1 %: least memory
    deg, secs, peak, plan, cross = min((c for c in fitting if c[0] == deg and c[1] <= 1.01 * fastest),
                                       key=lambda c: c[2])
    (R, S, tp), cp = plan.mesh_shape, plan.cp
    why = "no tp=1 layout fits, so tensor parallelism is needed; " if tp > 1 and cp == 1 else ""
    if cp > 1:
        why = (f"no layout of a smaller cp x tp fits, so context parallelism (cp={cp}) is needed"
               f"{f' with tp={tp}' if tp > 1 else ''}; ")
    if pp > 1:
        why = f"no layout with fewer pipeline stages fits, so pp={pp} (per stage: {R * S * cp * tp} ranks); " + why
    lines.append(f"chose {f'pp={pp}, ' if pp > 1 else ''}{f'cp={cp}, ' if cp > 1 else ''}tp={tp}, {plan.strategy} "
                 f"on dp_replicate={R} x dp_shard={S}: {why}it fits "
                 f"({fmt_bytes(peak)}) with the least estimated communication ({secs * 1e3:.1f} ms/step, "
                 f"{fmt_bytes(cross)} per rank across hosts)")
    return MeshSuggestion(R, S, tp, plan.strategy, plan, secs, cross, tuple(lines), pp, cp)
