"""The expert-parallel sub-meshes: ``ep`` carved out of ``dp_shard`` (x ``cp``), by rank layout.

[Note: the expert mesh]
``ep`` adds no ranks. Within one ``(pp, dp_replicate, tp)`` coordinate the ``dp_shard`` ranks
(times ``cp``, inner, where present) are flattened in mesh order and regrouped as
``dp_shard_mod_ep x ep``, ``ep`` inner (with ``cp`` and ``ep`` a multiple of it, whole
context-parallel groups). `expert_meshes` builds one new ``DeviceMesh`` over the world with axes
``([pp,] dp_replicate, dp_shard_mod_ep, ep, tp)`` (every rank must build it: `init_mesh(ep=N)`
does, once) and hands out its slices: ``ep``, the 1-D mesh the experts are split over
(`ExpertParallel`); ``dp``, what the experts' ``fully_shard`` takes (``dp_shard_mod_ep``, or
``(dp_replicate, dp_shard_mod_ep)`` for HSDP), one root's slices as ``fully_shard`` composes
them. One ``(dp_shard_mod_ep, ep)`` block is exactly one ``dp_shard (x cp)`` group of the main
mesh, so experts and dense weights are reduced over the same ranks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from ._axes import mesh_axes
from ._dims import dp_axis_names

__all__ = ["EP_AXIS", "EP_DP_AXIS", "ExpertMeshes", "expert_meshes", "remember_expert_meshes"]

EP_AXIS = "ep"
"""Name of the expert-parallel axis of the expert mesh."""

EP_DP_AXIS = "dp_shard_mod_ep"
"""Name of the axis of the data-parallel shard ranks left to the experts."""

# mesh -> (the degree init_mesh(ep=N) last built for it, {degree: ExpertMeshes}). DeviceMesh
# hashes by value, so an equal mesh built again shares the entry.
_BUILT: "weakref.WeakKeyDictionary[DeviceMesh, tuple[int | None, dict[int, ExpertMeshes]]]" = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ExpertMeshes:
    """The expert mesh of one main mesh (see [Note: the expert mesh]).

    Attributes:
        mesh: the whole-world mesh ``([pp,] dp_replicate, dp_shard_mod_ep, ep, tp)``.
        ep: its 1-D ``ep`` slice (this rank's expert-parallel group).
        dp: what ``fully_shard`` of the experts takes: ``dp_shard_mod_ep`` or, with
            ``dp_replicate > 1``, ``(dp_replicate, dp_shard_mod_ep)``.
        degree: ``ep``.
        dp_degree: the experts' whole data-parallel degree, ``dp_replicate * dp_shard_mod_ep``.
        ep_tp: the 2-D ``(ep, tp)`` slice where the mesh has a ``tp`` axis (None otherwise):
            what `ExpertTensorParallel` splits each expert's own weights over.
    """

    mesh: DeviceMesh
    ep: DeviceMesh
    dp: DeviceMesh
    degree: int
    dp_degree: int
    ep_tp: DeviceMesh | None = None


def expert_meshes(mesh: DeviceMesh, ep: int | None = None) -> ExpertMeshes:
    """The `ExpertMeshes` of ``mesh`` (an `init_mesh` mesh, or any mesh with ``dp_replicate`` and
    ``dp_shard`` axes; ``pp``, ``cp`` and ``tp`` are used when present).

    ``ep=None`` takes the degree ``init_mesh(ep=...)`` last built for this mesh (meshes compare
    by value, so for an equal mesh built again too; ``ValueError`` if none). Building a new one
    is collective: call it on every rank. Each degree's result is kept with the mesh, so later
    calls with that degree return it without communicating.
    """
    default, built = _BUILT.get(mesh, (None, {}))
    if ep is None:
        if default is None:
            raise ValueError("expert_meshes(mesh): this mesh was not built by init_mesh(ep=N); pass ep=N "
                             "(on every rank: building the expert mesh is collective)")
        return built[default]
    if ep not in built:
        built[ep] = _build(mesh, ep)
        _BUILT[mesh] = (default, built)
    return built[ep]


def remember_expert_meshes(mesh: DeviceMesh, ep: int) -> None:
    """Build the expert mesh of ``mesh`` now (collective) and make ``ep`` its default degree
    (`init_mesh` calls it for ``ep > 1``)."""
    expert_meshes(mesh, ep)
    _BUILT[mesh] = (ep, _BUILT[mesh][1])


def _build(mesh: DeviceMesh, ep: int) -> ExpertMeshes:
    axes = mesh_axes(mesh, "dp_replicate", "dp_shard", caller="expert_meshes()")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_meshes(ep={ep!r}): the expert-parallel degree must be a positive int")
    outer = [n for n in ("pp", "dp_replicate") if axes.has(n)]
    shard = [n for n in ("dp_shard", "cp") if axes.has(n)]
    inner = [n for n in ("tp",) if axes.has(n)]
    known = set(outer + shard + inner)
    unknown = [n for n in axes.names if n not in known]
    if unknown:
        raise ValueError(f"expert_meshes(): the mesh has axes {axes.names}; {unknown} is not one of pp, "
                         "dp_replicate, dp_shard, cp, tp, so where ep sits among them is undefined")
    extent = 1
    for n in shard:
        extent *= axes.size(n)
    if extent % ep != 0:
        formula = " * ".join(f"{n}({axes.size(n)})" for n in shard)
        raise ValueError(f"expert_meshes(ep={ep}): ep must divide {formula} = {extent}; {extent} % {ep} = "
                         f"{extent % ep} (expert parallelism adds no ranks)")
    order = [axes.index(n) for n in outer + shard + inner]
    ranks = mesh.mesh.permute(*order)
    shape = [axes.size(n) for n in outer] + [extent // ep, ep] + [axes.size(n) for n in inner]
    names = (*outer, EP_DP_AXIS, EP_AXIS, *inner)
    whole = DeviceMesh(mesh.device_type, ranks.reshape(shape), mesh_dim_names=names)
    replicate = axes.size("dp_replicate")
    dp_names = tuple(EP_DP_AXIS if n == "dp_shard" else n for n in dp_axis_names(replicate))
    dp = whole[dp_names[0]] if len(dp_names) == 1 else whole[dp_names]
    ep_tp = whole[(EP_AXIS, "tp")] if inner else None
    return ExpertMeshes(mesh=whole, ep=whole[EP_AXIS], dp=dp, degree=ep, dp_degree=replicate * extent // ep,
                        ep_tp=ep_tp)
