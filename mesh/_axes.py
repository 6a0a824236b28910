"""`mesh_axes`: the one way shardwise's entry points find the mesh axes they need, by name.

[Note: meshes by axis name]
An entry point (``data_parallel_mesh``, ``pipeline_mesh``, ``strategy_mesh``, ``pipeline_split``,
the pipeline's checkpoints) names the axes it needs and gets a `MeshAxes` view: sizes, this
rank's coordinate, sub-meshes in the order asked, and the global ranks sharing this rank's
coordinate on an axis. Nothing depends on where an axis sits: ``("dp", "pp")`` and ``("pp",
"dp")`` give the same answers; the layout is `init_mesh`'s choice, never an assumption of a
reader. A missing axis is a ``ValueError`` naming the mesh's axes, the missing ones and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from ._compat import flatten_axes
from ._dims import CP_AXIS, dp_axis_names

__all__ = ["DP_SHARD_CP", "MeshAxes", "mesh_axes"]

DP_SHARD_CP = "dp_shard_cp"
"""Name of the flattened ``dp_shard`` x ``cp`` axis that parameters are sharded over under CP."""

_FIX = ("build it with shardwise.mesh.init_mesh(), which always names ('dp_replicate', 'dp_shard', 'tp') "
        "(with 'pp' first when pp > 1), or name its axes (init_device_mesh(..., mesh_dim_names=...))")


@dataclass(frozen=True)
class MeshAxes:
    """A mesh and the names of its axes (``()`` for an unnamed mesh), from `mesh_axes`.

    Every method takes axis names; none depends on the axes' order in the mesh."""

    mesh: DeviceMesh
    names: tuple[str, ...]

    def has(self, name: str) -> bool:
        return name in self.names

    def index(self, name: str) -> int:
        """Position of ``name`` among the mesh's dimensions (``ValueError`` if absent)."""
        if name not in self.names:
            raise ValueError(f"the mesh has axes {self.names} but no {name!r} axis; {_FIX}")
        return self.names.index(name)

    def size(self, name: str) -> int:
        """Size of axis ``name``; 1 for an axis the mesh does not have."""
        return self.mesh.size(self.names.index(name)) if name in self.names else 1

    def sub(self, *names: str) -> DeviceMesh:
        """This rank's sub-mesh over ``names`` (the mesh itself if it is exactly that). Several
        names must come in the mesh's own order (torch slices only so; a new order would be a
        new mesh, built by every rank): ``ValueError`` naming both orders otherwise."""
        where = [self.index(n) for n in names]
        if where != sorted(where):
            raise ValueError(f"the mesh has axes {self.names}; the sub-mesh {tuple(names)} needs them in that order "
                             "(outer first), so build the mesh with its axes in that order")
        if tuple(names) == self.names:
            return self.mesh
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[tuple(names)]

    def coordinate(self, name: str) -> int:
        """This rank's index along axis ``name`` (``ValueError`` if this rank is not in the mesh)."""
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"this rank is not in the mesh {self.mesh.mesh.tolist()} (axes {self.names})")
        return coord[self.index(name)]

    def peers(self, name: str) -> tuple[int, ...]:
        """The global ranks whose coordinate on ``name`` equals this rank's, in mesh order (on the
        ``pp`` axis: the ranks of this rank's pipeline stage, over every other axis)."""
        return tuple(self.mesh.mesh.select(self.index(name), self.coordinate(name)).flatten().tolist())

    def data_parallel(self) -> DeviceMesh:
        """``sub("dp_shard")`` without replicas, else ``sub("dp_replicate", "dp_shard")`` (HSDP,
        replicate outer): the rule of `ParallelDims.dp_axis_names`. With a ``cp`` axis of size
        > 1 the shard axis is ``dp_shard_cp``, ``dp_shard`` and ``cp`` flattened (see
        `shard_axis_with_cp`)."""
        names = dp_axis_names(self.size("dp_replicate"))
        if self.size(CP_AXIS) > 1:
            shard = self.shard_axis_with_cp()
            return shard if len(names) == 1 else self.mesh[("dp_replicate", DP_SHARD_CP)]
        return self.sub(*names)

    # -- context parallelism (issue 25): parameters are sharded over dp_shard x cp
    def shard_axis_with_cp(self) -> DeviceMesh:
        """The 1-D ``dp_shard_cp`` mesh: this rank's ``dp_shard`` x ``cp`` ranks flattened
        row-major (cp innermost). The cp ranks of a sample hold the same weights, so
        ``fully_shard`` shards them over both axes and its reduce-scatter sums (and averages)
        their gradients over both, as torchtitan does."""
        if not (self.has("dp_shard") and self.has(CP_AXIS)):
            raise ValueError(f"the mesh has axes {self.names}; dp_shard_cp needs both 'dp_shard' and 'cp'; {_FIX}")
        return flatten_axes(self.sub("dp_shard", CP_AXIS), DP_SHARD_CP)


def mesh_axes(mesh: object, *required: str, caller: str = "shardwise") -> MeshAxes:
    """The `MeshAxes` view of ``mesh``, checked to be a ``DeviceMesh`` with every axis in
    ``required`` (by name, in any order). ``TypeError`` / ``ValueError`` start with ``caller``
    and say what to pass instead. See [Note: meshes by axis name]."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{caller}: expected a torch DeviceMesh (e.g. shardwise.mesh.init_mesh(...)), got "
                        f"{type(mesh).__name__} {mesh!r:.60}")
    names = tuple(mesh.mesh_dim_names or ())
    missing = [n for n in required if n not in names]
    if missing:
        raise ValueError(f"{caller}: the mesh has axes {names} but lacks {missing}; {_FIX}")
    return MeshAxes(mesh, names)
