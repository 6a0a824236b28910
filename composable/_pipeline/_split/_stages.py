"""``pipeline_split``: plan the stages of a model and keep this rank's; `PipelineSplit` holds them."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.mesh import PP_AXIS, mesh_axes

from ..._compat import root_mesh
from .._schedules import check_placement
from ._agree import agree, fingerprint
from ._cost import COST_KINDS, average_costs, measure_costs, param_costs
from ._partition import StagePlan, balanced_plan, plan_from_bounds
from ._split import StageShell, blocks_list, classify, find_layers, split_model

__all__ = ["PipelineSplit", "pipeline_split", "plan_stages"]


@dataclass
class PipelineSplit:
    """This rank's part of a pipelined model.

    ``module``: the rank model (only this rank's blocks, pre/post-modules on the first/last stage,
    unsplit names): build the optimizer on it and checkpoint it. ``stages``: this rank's
    `StageShell`s, to TP and ``fully_shard`` (each ``stage.blocks``, then ``stage.module``).
    ``plan``: the `StagePlan`. ``stage_ranks``: the global ranks holding this rank's stages (None
    when the mesh cannot tell).
    """

    module: nn.Module
    stages: list[StageShell]
    plan: StagePlan
    pp_group: object
    pp_rank: int
    pp_size: int
    virtual_stages: int
    fqns: tuple[str, ...]  # parameter names of the unsplit model, in order
    # transfers of failed steps still in flight, kept alive for as long as the split: see
    # [Note: after a failed step] in _p2p.py
    in_flight: list = field(default_factory=list, repr=False, compare=False)
    stage_ranks: tuple[int, ...] | None = None
    placement: str = "loop"  # [Note: stage placement] in _placement.py

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages


@dataclass(frozen=True)
class _Pipeline:
    group: object
    rank: int
    size: int
    stage_ranks: tuple[int, ...] | None


def _pipeline_of(pp_mesh: object) -> _Pipeline:
    """This rank's pipeline from ``pp_mesh``: the 1-D ``pp`` mesh, or any mesh with a ``pp``
    axis wherever it sits ([Note: meshes by axis name] in ``shardwise/mesh/_axes.py``)."""
    if pp_mesh is None:
        if not dist.is_initialized():
            return _Pipeline(None, 0, 1, (0,))
        return _Pipeline(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), (dist.get_rank(),))
    if not isinstance(pp_mesh, DeviceMesh):
        raise TypeError(f"pipeline_split: pp_mesh must be a DeviceMesh (shardwise.mesh.pipeline_mesh(mesh), or the "
                        f"mesh with a 'pp' axis itself) or None, got {type(pp_mesh).__name__} {pp_mesh!r:.40}")
    if pp_mesh.ndim != 1:
        try:
            pp_mesh = mesh_axes(pp_mesh, PP_AXIS, caller="pipeline_split").sub(PP_AXIS)
        except ValueError:
            raise ValueError(f"pipeline: pp_mesh must be the 1-D 'pp' mesh (shardwise.mesh.pipeline_mesh(mesh)) or a "
                             f"mesh with a 'pp' axis, got a {pp_mesh.ndim}-D mesh with axes "
                             f"{pp_mesh.mesh_dim_names}") from None
    return _Pipeline(pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size(), _stage_ranks(pp_mesh))


def _stage_ranks(pp_mesh: DeviceMesh) -> tuple[int, ...] | None:
    """The ranks of this rank's stage: those of the mesh ``pp_mesh`` was sliced from that share
    this rank's coordinate on its axis."""
    names = pp_mesh.mesh_dim_names or ()
    root = root_mesh(pp_mesh)
    if names and root is not pp_mesh and names[0] in (root.mesh_dim_names or ()):
        return mesh_axes(root).peers(names[0])
    if pp_mesh.mesh.numel() == dist.get_world_size():
        return (dist.get_rank(),)  # the pipeline is the whole world: one rank per stage
    return None


@dataclass(frozen=True)
class _Local:
    """What planning finds on this rank before any collective: the blocks list, the pre/post
    modules, and either a plan (explicit split points) or this rank's costs."""

    path: list
    names: list
    pre: list
    post: list
    blocks: list
    plan: StagePlan | None
    costs: tuple[float, list[float], float] | None
    measured: bool


def _local_plan(model: nn.Module, num_stages: int, layers: str | None, cost: str,
                split_points: Sequence[int] | None, sample: Callable[[nn.Module], torch.Tensor] | None,
                repeats: int) -> _Local:
    if cost not in COST_KINDS:
        raise ValueError(f"pipeline: cost={cost!r}; choose one of {COST_KINDS}")
    path, names = find_layers(model, layers)
    blocks = list(blocks_list(path, names))
    if num_stages > len(blocks):
        raise ValueError(
            f"pipeline: {num_stages} stages but the model has only {len(blocks)} blocks to split; every stage needs "
            f"at least one block: use at most {len(blocks)} stages (pp x virtual stages), or a model with more blocks")
    order = None
    if sample is not None:
        seen: list[nn.Module] = []
        hooks = [m.register_forward_pre_hook(lambda mod, a, seen=seen: seen.append(mod) if mod not in seen else None)
                 for node in path for m in node._modules.values() if m is not None]
        hooks += [blocks[0].register_forward_pre_hook(lambda mod, a: seen.append(mod) if mod not in seen else None)]
        try:
            with torch.no_grad():
                sample(model)
        finally:
            for h in hooks:
                h.remove()
        order = seen
    pre, post = classify(path, names, order)
    pre_mods = [m for d, n in pre if (m := path[d]._modules[n]) is not None]  # classify picks existing ones
    post_mods = [m for d, n in post if (m := path[d]._modules[n]) is not None]
    if split_points is not None:
        costs = param_costs(blocks, pre_mods, post_mods)
        plan = plan_from_bounds(costs[1], split_points, pre=costs[0], post=costs[2], cost_kind="params")
        return _Local(path, names, pre, post, blocks, plan, None, False)
    if cost == "params":
        return _Local(path, names, pre, post, blocks, None, param_costs(blocks, pre_mods, post_mods), False)
    if sample is None:
        raise ValueError(f"pipeline: cost={cost!r} measures a forward+backward, so it needs sample=: a function "
                         "that runs the unsplit model on a sample batch and returns the loss; or use "
                         "cost='params', or give split_points=")
    return _Local(path, names, pre, post, blocks, None,
                  measure_costs(model, blocks, lambda: sample(model), cost, repeats, average=False), True)


def _balance(local: _Local, num_stages: int, cost: str) -> StagePlan:
    """The plan; measured costs are averaged over the ranks first (a collective: agree before)."""
    if local.plan is not None:
        return local.plan
    assert local.costs is not None, "a local plan has a plan or costs"
    c = average_costs(local.costs) if local.measured else local.costs
    return balanced_plan(c[1], num_stages, pre=c[0], post=c[2], cost_kind=cost)


def plan_stages(model: nn.Module, num_stages: int, *, layers: str | None = None, cost: str = "time",
                split_points: Sequence[int] | None = None, sample: Callable[[nn.Module], torch.Tensor] | None = None,
                repeats: int = 3) -> tuple[StagePlan, list, list, list, list]:
    """Plan ``num_stages`` stages of the unsplit ``model`` without changing it; returns
    ``(plan, path, names, pre, post)`` (see `pipeline_split` for the arguments). Pure with
    ``split_points`` or ``cost="params"``; a measured cost is averaged over the default group,
    after the ranks agree on their outcome ([Note: agreeing before the first collective])."""
    measured = split_points is None and cost in ("time", "activations")
    try:
        local = _local_plan(model, num_stages, layers, cost, split_points, sample, repeats)
    except Exception as exc:
        if measured:
            agree("plan_stages", exc, None, None)
        raise
    if measured:
        agree("plan_stages", None, *fingerprint(model, local.blocks))
    return _balance(local, num_stages, cost), local.path, local.names, local.pre, local.post


_SPLIT: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models and stage shells pipeline_split made


def pipeline_split(model: nn.Module, pp_mesh: DeviceMesh | None = None, *, virtual_stages: int = 1,
                   layers: str | None = None, cost: str = "time", split_points: Sequence[int] | None = None,
                   sample: Callable[[nn.Module], torch.Tensor] | None = None, repeats: int = 3,
                   verbose: bool = True, placement: str = "loop") -> PipelineSplit:
    """Split ``model`` into ``pp * virtual_stages`` contiguous stages and keep this rank's.

    Call on every rank with the same unsplit model (same seed), before TP and ``fully_shard``.
    ``pp_mesh``: the 1-D ``pp`` mesh or a mesh with a ``pp`` axis (None: the default group).

    Args:
        virtual_stages: stages per rank (``> 1`` for the interleaved schedules, 2 for ``zbv``).
        placement: ``"loop"`` (stage ``s`` on rank ``s % pp``) or ``"v"`` (``zbv``'s V); the
            schedule's own ([Note: stage placement] in ``_pipeline/_schedules/_placement.py``).
        layers: dotted path of the blocks list; default ``layers`` or ``model.layers``.
        cost: what to balance: ``"time"`` (measured on ``sample``, averaged over ranks),
            ``"params"`` (bytes) or ``"activations"`` (bytes saved for backward on ``sample``).
        split_points: block indices where stages 1.. start (or full bounds); nothing is measured.
        sample: ``sample(model) -> loss`` on a sample batch (for time/activations, and to tell
            pre- from post-modules).
        verbose: print the plan on global rank 0.

    Errors are the same on every rank ([Note: agreeing before the first collective]).
    """
    pipe = _pipeline_of(pp_mesh)
    group, pp_rank, pp = pipe.group, pipe.rank, pipe.size
    error: BaseException | None = None
    local = None
    try:
        check_placement(placement)
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"pipeline: virtual_stages={virtual_stages!r}; it must be a positive int")
        if model in _SPLIT:
            raise ValueError("pipeline_split: this model was already split (it holds only this rank's stages "
                             "now); split the unsplit model once: build it again (same seed) to split it another way")
        num_stages = pp * virtual_stages
        local = _local_plan(model, num_stages, layers, cost, split_points, sample, repeats)
        if local.plan is not None and local.plan.num_stages != num_stages:
            raise ValueError(f"pipeline: split_points {list(split_points or ())} make {local.plan.num_stages} stages, "
                             f"but pp ({pp}) x virtual_stages ({virtual_stages}) = {num_stages}; give "
                             f"{num_stages - 1} points")
    except Exception as exc:  # noqa: BLE001 - agreed with the other ranks, then raised on every rank
        error = exc
    agree("pipeline_split", error, *fingerprint(model, local.blocks if local is not None else None))
    assert local is not None
    fqns = tuple(n for n, _ in model.named_parameters())
    plan = _balance(local, num_stages, cost)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(plan.describe(pp, placement), flush=True)
    shells = split_model(model, local.path, local.names, local.pre, local.post, plan.bounds, pp, pp_rank, placement)
    _SPLIT.add(model)
    for shell in shells:
        _SPLIT.add(shell.module)
    return PipelineSplit(model, shells, plan, group, pp_rank, pp, virtual_stages, fqns,
                         stage_ranks=pipe.stage_ranks, placement=placement)
