"""The fully_shard wing: FSDP / ZeRO-3 on a 1-D mesh, HSDP on a 2-D replicate x shard mesh.

One file per concept (docs/architecture.md maps them). This wing imports only the shared leaves
of ``composable`` (``_compat``, ``_mesh_utils``, ``_chunks``) and ``shardwise.mesh`` (no
checkpoint code: the full-state scatter is passed in, `broadcast_state`); the other wings use it
through the names below, and drive a unit through `UnitHandle` (what `units_of` returns;
`FSDPState` implements it): its step override and settings, ``unshard``, ``finish_backward`` /
``abandon_step``.
"""

from ._comm import AllGather, ReduceScatter
from ._fully_shard import (FSDPModule, FullyShardUsageError, UnshardHandle, fully_shard, register_fsdp_forward_method,
                           share_comm_ctx)
from ._layout import make_layout
from ._materialize import FullScatter, broadcast_state, materialize
from ._override import StepOverride, UnitHandle, clear_override, configured, override_unit, units_of
from ._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._state import FSDPState

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "FullyShardUsageError",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "AllGather",
    "ReduceScatter",
    "materialize",
    "broadcast_state",
    "FullScatter",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    # the interface other wings drive units through ([Note: step overrides])
    "StepOverride",
    "override_unit",
    "clear_override",
    "configured",
    "units_of",
    "UnitHandle",
    "FSDPState",  # the unit handle
    "make_layout",  # the shard layout of one parameter, for the planner
]
